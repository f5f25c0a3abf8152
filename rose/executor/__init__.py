"""The executor: its pure lease state machine, the local guard, and the service that obeys commands."""
