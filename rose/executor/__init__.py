"""The executor: its pure lease state machine, the local guard, the service that obeys commands,
a lease's worker processes and the pool of warm workers."""
