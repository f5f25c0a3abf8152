"""HMAC-SHA256 signatures of command values (optional; on when `security.command_hmac_key` is set).

The scheduler signs each command's value bytes and puts the hex digest in the `rose-signature`
Kafka header; executors refuse a command whose signature is missing or wrong (dead-letter, with
the reason). It authenticates the command stream against anyone who can write to the topic
without the key; Kafka ACLs remain the first line.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "rose-signature"


def _key(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else key


def sign(key: str | bytes, value: bytes) -> str:
    """Hex HMAC-SHA256 of `value`."""
    return hmac.new(_key(key), value, hashlib.sha256).hexdigest()


def sign_headers(key: str | bytes, value: bytes) -> list[tuple[str, bytes]]:
    """The Kafka header list that signs `value` (append it to the message's headers)."""
    return [(SIGNATURE_HEADER, sign(key, value).encode())]


def verify(key: str | bytes, value: bytes | None, signature: bytes | str | None) -> str | None:
    """None when `signature` is a valid signature of `value`; otherwise the reason it is not."""
    if signature is None:
        return f"{SIGNATURE_HEADER}: missing (commands must be signed)"
    if isinstance(signature, bytes):
        signature = signature.decode("ascii", "replace")
    if not hmac.compare_digest(sign(key, value or b""), signature.strip().lower()):
        return f"{SIGNATURE_HEADER}: does not match the value (wrong key or altered message)"
    return None
