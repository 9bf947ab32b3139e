"""The tiny model, SFT and GRPO trainers, checkpoint format and the train job (torch + stdlib)."""
