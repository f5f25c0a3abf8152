"""The pure scheduling core: the lease policy, the fold around it, replay."""
