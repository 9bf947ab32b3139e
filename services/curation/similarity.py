"""Content hashes, MinHash signatures and LSH bands: how curation tells tasks apart.

- **Exact duplicates** share a content hash: sha256 of the task's canonical JSON (prompt,
  tools, verifier, reference answer) with the prompt normalized (Unicode NFKC, runs of
  whitespace collapsed, ends stripped). Metadata is not content.
- **Similarity** is the Jaccard similarity of the sets of character 5-gram shingles of the
  normalized, case-folded prompt, estimated by a 128-permutation MinHash (datasketch,
  ``affine32`` scheme, fixed seed). Very long prompts are shingled on their first and last
  8,000 characters.
- **Candidates** come from LSH: the first 64 MinHash values form 16 bands of 4 rows; two
  tasks are compared only when some band is identical. A pair of similarity ``s`` shares a
  band with probability ``1 - (1 - s**4)**16``: 0.70 at 0.5, 0.89 at 0.6, 0.99 at 0.7,
  1.00 at 0.8 and above. The bands are persisted (``lsh_buckets``), so they are a fixed
  part of the storage format: thresholds can change freely, the banding cannot.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from datasketch import MinHash

NUM_PERM = 128
SEED = 1
SCHEME = "affine32"
SHINGLE = 5
BANDS = 16
ROWS = 4
MAX_SHINGLED_CHARS = 16_000

Signature = npt.NDArray[np.uint32]

_WHITESPACE = re.compile(r"\s+")
_PERMUTATIONS = MinHash(num_perm=NUM_PERM, seed=SEED, scheme=SCHEME).permutations


def normalize_prompt(prompt: str) -> str:
    """NFKC, whitespace runs collapsed to one space, ends stripped: what the hash sees."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", prompt)).strip()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(
    *,
    environment: str,
    prompt: str,
    tools: Sequence[Mapping[str, Any]],
    verifier: Mapping[str, Any],
    reference_answer: str | None,
) -> str:
    """sha256 of the normalized task content; equal hashes are exact duplicates."""
    content = {
        "environment": environment,
        "prompt": normalize_prompt(prompt),
        "tools": list(tools),
        "verifier": dict(verifier),
        "reference_answer": reference_answer,
    }
    return hashlib.sha256(_canonical(content).encode("utf-8")).hexdigest()


def verifier_key(verifier: Mapping[str, Any]) -> str:
    """A short digest of the verifier spec: near duplicates must share it."""
    return hashlib.sha256(_canonical(dict(verifier)).encode("utf-8")).hexdigest()[:32]


def shingles(prompt: str) -> list[bytes]:
    """Character 5-grams of the normalized, case-folded prompt (as UTF-8 bytes)."""
    text = normalize_prompt(prompt).casefold()
    if len(text) > MAX_SHINGLED_CHARS:
        half = MAX_SHINGLED_CHARS // 2
        text = text[:half] + "\x00" + text[-half:]
    if len(text) <= SHINGLE:
        return [text.encode("utf-8")]
    grams = {text[i : i + SHINGLE] for i in range(len(text) - SHINGLE + 1)}
    return [g.encode("utf-8") for g in sorted(grams)]


def signature(prompt: str) -> Signature:
    """The prompt's MinHash signature: 128 unsigned 32-bit values."""
    minhash = MinHash(num_perm=NUM_PERM, seed=SEED, scheme=SCHEME, permutations=_PERMUTATIONS)
    minhash.update_batch(shingles(prompt))
    return np.asarray(minhash.hashvalues, dtype=np.uint32)


def signature_to_bytes(sig: Signature) -> bytes:
    return sig.astype("<u4").tobytes()


def signature_from_bytes(raw: bytes) -> Signature:
    if len(raw) != NUM_PERM * 4:
        raise ValueError(
            f"a stored MinHash signature has {len(raw)} bytes, expected {NUM_PERM * 4}"
        )
    return np.frombuffer(raw, dtype="<u4").astype(np.uint32)


def band_keys(sig: Signature) -> list[tuple[int, bytes]]:
    """The LSH bands of a signature: ``(band number, 16-byte bucket key)``."""
    head = sig[: BANDS * ROWS].astype("<u4").tobytes()
    width = ROWS * 4
    return [(band, head[band * width : (band + 1) * width]) for band in range(BANDS)]


def jaccard(a: Signature, b: Signature) -> float:
    """Estimated Jaccard similarity of the two shingle sets."""
    return float(np.count_nonzero(a == b)) / NUM_PERM


def jaccard_many(sig: Signature, others: npt.NDArray[np.uint32]) -> npt.NDArray[np.float64]:
    """Estimated similarity of ``sig`` to each row of ``others`` (shape ``(n, NUM_PERM)``)."""
    if others.size == 0:
        return np.zeros(0, dtype=np.float64)
    result: npt.NDArray[np.float64] = (others == sig).mean(axis=1)
    return result


def stack(signatures: Iterable[Signature]) -> npt.NDArray[np.uint32]:
    rows = list(signatures)
    if not rows:
        return np.zeros((0, NUM_PERM), dtype=np.uint32)
    return np.vstack(rows).astype(np.uint32)
