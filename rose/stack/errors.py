"""What goes wrong starting the local stack: the message says what to install or fix, or whose
stack holds this one's ports."""


class StackError(RuntimeError):
    """The stack cannot be started; the message says what to install or fix."""


class NotOwnedError(StackError):
    """This stack's ports are held by another stack (another checkout) or another program."""
