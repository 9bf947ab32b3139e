"""The ``hf`` model family: any transformers causal LM, full or LoRA, prompted in chat."""
