"""Post agent traces to Ratchet without installing Ratchet: signing, batching, retries.

See README.md. The signature is the Standard Webhooks scheme Ratchet's webhook verifies:
``v1,<base64 HMAC-SHA256 of "<webhook-id>.<webhook-timestamp>.<body>">`` keyed with the
base64 part of the loop's ``whsec_...`` secret.
"""

from __future__ import annotations

from ratchet_client._client import (
    AsyncTraceClient,
    FeedbackResult,
    IngestResult,
    RatchetError,
    RatchetUnreachable,
    TraceClient,
)
from ratchet_client._signing import sign, signed_headers

__all__ = [
    "AsyncTraceClient",
    "FeedbackResult",
    "IngestResult",
    "RatchetError",
    "RatchetUnreachable",
    "TraceClient",
    "sign",
    "signed_headers",
]
__version__ = "0.1.0"
