"""`ratchet loop show` says what the next cycle waits for and when pending traces will be
curated; `ratchet loop run-now` on a loop with no champion says how to get one (real api
and Postgres)."""

from __future__ import annotations

import pytest
from ratchet_client import TraceClient

from tests.services.api.support import make_trace
from tests.services.cli.support import run

NO_CHAMPION = (
    "no champion: run `ratchet loop bootstrap calc` (a first one from the loop's successful "
    "traces) or import one: `ratchet models smollm2 --import --loop calc`, "
    "`ratchet models import DIR --loop calc`"
)


def test_show_says_what_the_next_cycle_waits_for(
    api_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "loop", "create", "calc", "--env", "toolcalc", "--show-secrets")
    assert code == 0
    [secret] = [w for w in out.split() if w.startswith("whsec_")]
    with TraceClient(api_url, "calc", secret) as client:
        assert client.post([make_trace("c1")]).accepted == 1

    code, out, _ = run(capsys, "loop", "show", "calc")
    assert code == 0
    assert (
        "  next cycle   waits for\n"
        "    - 0 of 32 new train tasks (trigger_policy.min_new_tasks)\n"
        "    - no eval tasks yet (a cycle's snapshot needs one; curation holds out a share of "
        "the failure clusters for eval: curation_policy.eval_fraction)\n"
        f"    - {NO_CHAMPION}\n"
        "  pending      1 trace waits for curation: curated at the loop's next trigger check "
        "(every 30 s while the loop waits)\n"
    ) in out

    code, out, err = run(capsys, "loop", "run-now", "calc")
    assert (code, out) == (1, "")
    assert err == f"ratchet: error: loop 'calc' cannot run a cycle: {NO_CHAMPION}\n"
