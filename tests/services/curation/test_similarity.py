"""MinHash signatures: the vectorised computation is datasketch's, bit for bit."""

from __future__ import annotations

import random
import string

import numpy as np
import pytest
from datasketch import MinHash

from services.curation.similarity import (
    MAX_SHINGLED_CHARS,
    NUM_PERM,
    SCHEME,
    SEED,
    band_keys,
    shingles,
    signature,
)


def datasketch_signature(prompt: str) -> np.ndarray:
    minhash = MinHash(num_perm=NUM_PERM, seed=SEED, scheme=SCHEME)
    minhash.update_batch(shingles(prompt))
    return np.asarray(minhash.hashvalues, dtype=np.uint32)


def prompts() -> list[str]:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + " \n\t.,:;!?éßΩ漢字"
    out = [
        "",
        "a",
        "abcde",
        "abcdef",
        "  Hello   World  ",
        "\uff26\uff35\uff2c\uff2c width",
        "x" * 40,
    ]
    out += ["".join(rng.choices(alphabet, k=rng.randint(6, 400))) for _ in range(60)]
    out.append("".join(rng.choices(alphabet, k=MAX_SHINGLED_CHARS + 1234)))
    return out


@pytest.mark.parametrize("prompt", prompts())
def test_signature_equals_datasketchs_minhash(prompt: str) -> None:
    ours = signature(prompt)
    assert ours.dtype == np.uint32 and ours.shape == (NUM_PERM,)
    assert np.array_equal(ours, datasketch_signature(prompt))


def test_band_keys_are_the_first_64_values_in_16_bands_of_4() -> None:
    sig = signature("what is 863+395")
    bands = band_keys(sig)
    assert [band for band, _ in bands] == list(range(16))
    head = sig[:64].astype("<u4")
    for band, bucket in bands:
        assert bucket == head[band * 4 : band * 4 + 4].tobytes()
