"""HMAC-SHA256 with a run's shared token: the one signing primitive of the project.

The weight-sync rendezvous (admission proofs, signed store messages, liveness pings) and
the reward protocol (the judge's request signatures) sign with the same construction; one
module keeps them from drifting apart (the token's encoding, the digest, the constant-time
comparison).

Must not: do I/O.
"""

from __future__ import annotations

import hashlib
import hmac


def hmac_hex(token: str, message: bytes) -> str:
    """HMAC-SHA256 of ``message`` under ``token``, as lowercase hex."""
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def hmac_matches(token: str, message: bytes, signature: str | None) -> bool:
    """Whether ``signature`` is ``hmac_hex(token, message)``, compared in constant time."""
    return signature is not None and hmac.compare_digest(hmac_hex(token, message), signature)
