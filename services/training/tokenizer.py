"""Byte-level tokenizer: one token per UTF-8 byte, 256 ids, nothing to train.

A byte vocabulary keeps the reference policy honest and small: any text (tool listings,
tool results, JSON arguments) is representable, there is no merge table to ship, and a
tokenizer file only needs to say "bytes". Decoding uses ``surrogateescape`` so that
``encode(decode(ids)) == ids`` for every id sequence, even bytes that are not valid UTF-8:
rollouts re-encode sampled text and must get back exactly the tokens that were sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_SCHEMA = "ratchet.tokenizer/v1"


class TokenizerError(ValueError):
    """A tokenizer file that this code cannot use."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Maps text to UTF-8 byte ids and back; ``stop`` ends a generated turn."""

    stop: str = "\n"

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def stop_id(self) -> int:
        return self.encode(self.stop)[0]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="surrogateescape")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": TOKENIZER_SCHEMA, "type": "byte", "vocab_size": 256, "stop": self.stop}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ByteTokenizer:
        if data.get("schema") != TOKENIZER_SCHEMA or data.get("type") != "byte":
            raise TokenizerError(f"unsupported tokenizer: {data.get('schema')}/{data.get('type')}")
        stop = data.get("stop", "\n")
        if not isinstance(stop, str) or len(stop.encode("utf-8")) != 1:
            raise TokenizerError(f"tokenizer stop must be a single byte, got {stop!r}")
        return cls(stop=stop)

    @classmethod
    def load(cls, path: Path) -> ByteTokenizer:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise TokenizerError(f"tokenizer {path} is not a JSON object")
        return cls.from_dict(data)
