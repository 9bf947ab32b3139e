"""The closed-loop test's champion: ``python -m tests.e2e.champion_fixture`` rebuilds it.

A tiny GPT (the policy's default size) SFT'd with ``ratchet demo``'s champion settings on
toolcalc v1 demonstrations, **pre-exposed to v2's names**: 30 % of the demonstrations show
v2's deprecation window (v2's listing, old names mostly, a quarter already the new ones;
see docs/environments.md), and v1 accepts v2's names as aliases. That is what lets GRPO on
a few dozen curated v2 failures win the gate in CI time: it amplifies a habit the champion
has. Measured pass rates are in tests/e2e/test_closed_loop.py's docstring.

Its training takes longer than the closed-loop test may take in CI, so the checkpoint is
committed (about 2 MB of safetensors plus the manifest with every file's sha256); this
module is how it was made, and rebuilding it with the same settings gives the same weights
on the same torch build.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "toolcalc-champion"

SFT_TASKS = 4000
SFT_STEPS = 1000
AUGMENT_FRACTION = 0.3


def build(out_dir: Path) -> None:
    import torch

    from services.environments import get_environment
    from services.training.sft import SFTConfig, make_champion
    from services.training.tiny.model import GPTConfig

    torch.set_num_threads(1)
    env = get_environment("toolcalc")
    tasks = env.generate_tasks(SFT_TASKS, seed=1, api_version="v1")
    make_champion(
        env,
        out_dir,
        tasks=tasks,
        model_config=GPTConfig(),
        config=SFTConfig(steps=SFT_STEPS, batch_size=32, lr=3e-3, warmup=30, log_every=100),
        augment_fraction=AUGMENT_FRACTION,
        device="cpu",
    )


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target = Path(argv[0]) if argv else FIXTURE
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    build(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
