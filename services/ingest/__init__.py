"""The front door: trace schema v1, webhook signatures, OTLP mapping, OTLP episode assembly
(episodes, span_store) and the group-commit writer.

Nothing a client was told is stored may be lost: the writer acknowledges a trace only after
the transaction holding it has committed. See docs/ingest.md.
"""
