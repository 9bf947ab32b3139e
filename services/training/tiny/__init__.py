"""The tiny family: a small byte-level GPT, its batched generation and text rollouts."""
