"""The model server (``ratchet serve``, ``python -m services.modelserver``): the
OpenAI-compatible API over the one engine (:mod:`services.inference`), batched, hot-swapping
full models and LoRA adapters, counting what each served version spent and signing its
response ids. What vLLM or SGLang are on a GPU cluster, for a laptop and for CI.

The serving targets (:mod:`services.serving`) drive it, or vLLM, from the worker; this
package never imports them. See docs/design.md ("Serving")."""
