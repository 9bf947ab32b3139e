"""`ratchet traces list --reason` with a reason no trace has lists the loop's reasons, so a
mistyped code is seen as one (real api and database)."""

from __future__ import annotations

import pytest

from services.db.session import SessionFactory
from tests.services.cli.support import run
from tests.services.cli.test_traces_cli import make_loop, seed


def test_an_unknown_reason_lists_the_reasons_the_loop_has(
    api_url: str, capsys: pytest.CaptureFixture[str], session_factory: SessionFactory
) -> None:
    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--reason", "bogus")
    assert code == 1  # no loop yet
    loop = make_loop(capsys)
    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--reason", "bogus")
    assert (code, out) == (
        0,
        "loop 'helpdesk' has no traces that match\n"
        "no trace of loop 'helpdesk' has a reason yet (`ratchet loop show helpdesk`)\n",
    )
    seed(api_url, loop, session_factory)

    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--reason", "bogus")
    assert (code, out) == (
        0,
        "loop 'helpdesk' has no traces that match\n"
        "no trace of loop 'helpdesk' has reason 'bogus'; the reasons its traces have: "
        "no outcome reported (1), unknown_api_version (2)\n",
    )
    # A reason the loop has, outside the other filters: nothing more to say.
    code, out, _ = run(
        capsys,
        "traces",
        "list",
        "helpdesk",
        "--reason",
        "unknown_api_version",
        "--since",
        "2999-01-01T00:00:00Z",
    )
    assert (code, out) == (0, "loop 'helpdesk' has no traces that match\n")
