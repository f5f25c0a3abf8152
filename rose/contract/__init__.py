"""The wire: typed events, their bytes, their signatures."""
