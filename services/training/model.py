"""Where the tiny model lived before the family packages: :mod:`services.training.tiny.model`.

Kept only for code other branches edit in parallel (``services/serving``, and tests outside
``tests/services/training``), which import these names from here; once they import
:mod:`services.training.tiny.model` this module goes.
"""

from services.training.tiny.model import GPT, GPTConfig, KVCache, TinyModel

__all__ = ["GPT", "GPTConfig", "KVCache", "TinyModel"]
