"""docs/loops.md's loop file is one `ratchet loop apply` accepts: every policy in it is
valid as written (a serving target without its `url` was refused)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.loop.policies import GatePolicy, ServingTarget, TrainingProfile, TriggerPolicy

DOC = Path(__file__).resolve().parents[3] / "docs" / "loops.md"


def test_the_documented_loop_file_is_valid() -> None:
    [first, *_] = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    document = yaml.safe_load(first)
    ServingTarget.model_validate(document["serving_target"])
    TrainingProfile.model_validate(document["training_profile"])
    GatePolicy.model_validate(document["gate_policy"])
    TriggerPolicy.model_validate(document["trigger_policy"])


def test_the_documented_curl_sets_every_variable_it_uses() -> None:
    text = DOC.read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "curl" not in block:
            continue
        used = set(re.findall(r"\$\{?([A-Z_]+)", block))
        assigned = set(re.findall(r"^([A-Z_]+)=", block, flags=re.M))
        assert used <= assigned, f"unset in docs/loops.md's curl: {sorted(used - assigned)}"
