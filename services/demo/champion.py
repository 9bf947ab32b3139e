"""The demo's first champion: SFT on toolcalc v1 demonstrations, made through the job contract.

The toy champion is pre-exposed to v2's names: ``augment_fraction`` of its SFT
demonstrations show v2's deprecation window (old names mostly, some new), and v1 accepts
v2's names as aliases, so GRPO only has to amplify what sampling already finds.
:func:`champion_note` is what every report says about it. ``--model smollm2`` makes a real
LM's champion instead (services/demo/smollm2.py).
"""

from __future__ import annotations

from pathlib import Path

from services.demo import smollm2
from services.demo.options import DemoOptions, Printer
from services.demo.sft import champion_from_v1_demonstrations, champion_work_dir
from services.settings import Settings


def make_demo_champion(options: DemoOptions, settings: Settings, out: Printer) -> Path:
    """The checkpoint directory of the champion ``options.model`` asks for."""
    if options.model == "smollm2":
        return smollm2.make_champion(
            options.champion_cache or settings.state_dir, settings.artifacts_dir, out
        )
    return make_champion(settings.state_dir, options, out)


def make_champion(state_dir: Path, options: DemoOptions, out: Printer) -> Path:
    """The first champion: SFT on toolcalc v1 demonstrations.

    Kept in ``champion_cache`` keyed by its settings, so a second demo reuses it (the job is
    deterministic for the same settings; reuse only saves the minutes it takes).
    """
    work = champion_work_dir(
        options.champion_cache or state_dir,
        "champion",
        [options.sft_hyperparameters, options.sft_tasks],
    )
    return champion_from_v1_demonstrations(
        work,
        name="champion",
        task_count=options.sft_tasks,
        run_id="demo-champion-sft",
        hyperparameters=options.sft_hyperparameters,
        announce="[demo] making the first champion: SFT on {n} toolcalc v1 demonstrations ...",
        out=out,
    )


def champion_note(options: DemoOptions) -> str:
    """What every report must say about the champion the loop started from."""
    if options.model == "smollm2":
        return smollm2.CHAMPION_NOTE
    share = float(options.sft_hyperparameters.get("augment_fraction", 0.0))
    if share <= 0:
        return "champion: SFT on toolcalc v1 demonstrations only (not exposed to v2's names)"
    return (
        f"champion pre-exposed to v2's names: {share:.0%} of its SFT demonstrations show v2's "
        "deprecation window, and v1 accepts v2's names as aliases; the recovery measures "
        "amplifying a habit the champion has, not learning a drift from nothing"
    )
