"""What the hf family's callers need to know of transformers' KV cache across its 5.x releases.

Standard library only: transformers is the caller's import.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """The name under which ``model``'s forward takes (and its output carries) the KV cache:
    transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns, and goes
    in 5.40); a peft wrapper's forward passes it through to its base model's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
