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
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from datasketch import MinHash

from services.environments.base import TaskSpec

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
_PERM_A = np.asarray(_PERMUTATIONS[0], dtype=np.uint32)
_PERM_B = np.asarray(_PERMUTATIONS[1], dtype=np.uint32)


def normalize_prompt(prompt: str) -> str:
    """NFKC, whitespace runs collapsed to one space, ends stripped: what the hash sees."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", prompt)).strip()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTF-8 as is: the text every content hash is taken of."""
    return _canonical(value)


def dedup_key(task: TaskSpec, *, tools_json: str | None = None) -> str:
    """Curation's dedup key: sha256 of the task content with its prompt normalized; equal
    keys are exact duplicates. Stored in ``tasks.content_hash``. Not the task id
    (:func:`services.environments.base.compute_task_id`, of the content as it is).

    ``tools_json``, when the caller has it, is ``canonical_json(task.tools)``: the tool specs
    are most of a task's bytes, and the canonical text of the whole content is assembled from
    its sorted keys' canonical values, so they need not be encoded again.
    """
    tools_text = tools_json if tools_json is not None else _canonical(list(task.tools))
    text = (
        f'{{"environment":{_canonical(task.environment)},'
        f'"prompt":{_canonical(normalize_prompt(task.prompt))},'
        f'"reference_answer":{_canonical(task.reference_answer)},'
        f'"tools":{tools_text},'
        f'"verifier":{_canonical(dict(task.verifier))}}}'
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def verifier_key(verifier: Mapping[str, Any]) -> str:
    """A short digest of the verifier spec: near duplicates must share it."""
    return hashlib.sha256(_canonical(dict(verifier)).encode("utf-8")).hexdigest()[:32]


def shingles(prompt: str) -> list[bytes]:
    """Character 5-grams of the normalized, case-folded prompt (as UTF-8 bytes)."""
    return [g.encode("utf-8") for g in sorted(_gram_set(prompt))]


def signature(prompt: str) -> Signature:
    """The prompt's MinHash signature: 128 unsigned 32-bit values.

    Bit for bit what ``datasketch.MinHash(num_perm=128, seed=1, scheme="affine32")`` gives
    after ``update_batch(shingles(prompt))`` (a test holds the two equal), computed as one
    (shingles x permutations) array: the per-shingle SHA-1 is the only Python loop left,
    and no MinHash object is built per prompt.
    """
    grams = _gram_set(prompt)
    digests = b"".join([hashlib.sha1(g.encode("utf-8")).digest()[:4] for g in grams])
    hashed = _fmix32(np.frombuffer(digests, dtype="<u4").astype(np.uint32))
    permuted = hashed[:, np.newaxis] * _PERM_A + _PERM_B  # (shingles, NUM_PERM), mod 2**32
    result: Signature = permuted.min(axis=0)
    return result


def _gram_set(prompt: str) -> set[str] | list[str]:
    text = normalize_prompt(prompt).casefold()
    if len(text) > MAX_SHINGLED_CHARS:
        half = MAX_SHINGLED_CHARS // 2
        text = text[:half] + "\x00" + text[-half:]
    if len(text) <= SHINGLE:
        return [text]
    return {text[i : i + SHINGLE] for i in range(len(text) - SHINGLE + 1)}


def _fmix32(values: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """MurmurHash3's 32-bit finalizer, as datasketch's affine32 scheme pre-mixes inputs."""
    values = values ^ (values >> np.uint32(16))
    values = values * np.uint32(0x85EBCA6B)
    values = values ^ (values >> np.uint32(13))
    values = values * np.uint32(0xC2B2AE35)
    result: npt.NDArray[np.uint32] = values ^ (values >> np.uint32(16))
    return result


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
