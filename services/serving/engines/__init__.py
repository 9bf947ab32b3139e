"""Model family engines: what the model server drives to decode one family's checkpoints."""
