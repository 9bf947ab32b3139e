"""The model server's routes, one module per kind of question: completions (chat and text),
models (the list, and vLLM's adapter load and unload), and status (health, stats, metrics)."""
