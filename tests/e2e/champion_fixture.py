"""The closed-loop test's champion: ``python -m tests.e2e.champion_fixture`` rebuilds it.

A tiny GPT (the policy's default size) SFT'd on toolcalc v1 demonstrations only — *not*
pre-exposed to v2's names, unlike ``ratchet demo``'s champion (measured with the evaluator:
greedy pass rate 0.65 on 40 fresh v1 tasks, 0.0 on 40 v2 tasks). Its training takes longer
than the closed-loop test may take in CI, so the checkpoint is committed (about 2 MB of
safetensors plus the manifest with every file's sha256); this module is how it was made,
and rebuilding it with the same settings gives the same weights on the same torch build.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "toolcalc-champion"

SFT_TASKS = 2000
SFT_STEPS = 600
AUGMENT_FRACTION = 0.0


def build(out_dir: Path) -> None:
    import torch

    from services.environments import get_environment
    from services.training.policy import GPTConfig
    from services.training.sft import SFTConfig, make_champion

    torch.set_num_threads(1)
    env = get_environment("toolcalc")
    tasks = env.generate_tasks(SFT_TASKS, seed=1, api_version="v1")
    make_champion(
        env,
        out_dir,
        tasks=tasks,
        model_config=GPTConfig(),
        config=SFTConfig(steps=SFT_STEPS, batch_size=32, lr=3e-3, warmup=20, log_every=100),
        augment_fraction=AUGMENT_FRACTION,
        device="cpu",
    )


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else FIXTURE
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    build(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
