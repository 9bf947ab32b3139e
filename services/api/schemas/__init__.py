"""Wire models (``TraceIn``, ``LoopPublic``...), kept separate from the tables."""
