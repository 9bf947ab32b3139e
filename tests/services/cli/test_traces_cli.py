"""`ratchet traces list|show` (with the facts a trace's task checks, as `ratchet tasks show`
prints them), the curation counts of `ratchet loop show`, `--version`, and the one way to
name a loop, against a real api and database."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ratchet_client import TraceClient
from sqlalchemy import select

from services.db.models import Task, TaskSource, Trace
from services.db.queries.traces import Verdict, mark_traces_curated
from services.db.session import SessionFactory
from services.environments.base import TaskSpec
from services.environments.replay import ReplayEnvironment
from services.settings import get_settings
from tests.services.api.support import make_trace
from tests.services.cli.support import run
from tests.services.environments.replay_traces import failing_trace


def make_loop(capsys: pytest.CaptureFixture[str], name: str = "helpdesk") -> dict[str, Any]:
    code, out, err = run(
        capsys, "loop", "create", name, "--env", "toolcalc", "--json", "--show-secrets"
    )
    assert code == 0, err
    created: dict[str, Any] = json.loads(out)
    return created


def seed(api_url: str, loop: dict[str, Any], session_factory: SessionFactory) -> None:
    traces = [make_trace(f"tk-{i}") for i in range(4)]
    with TraceClient(api_url, loop["name"], loop["signing_secret"]) as client:
        result = client.post(traces)
    assert result.accepted == 4
    with session_factory.begin() as session:
        ids = dict(session.execute(select(Trace.external_id, Trace.id)).all())
        mark_traces_curated(
            session=session,
            verdicts=[
                Verdict(ids["tk-0"], "rejected", "unknown_api_version: tools match no version"),
                Verdict(ids["tk-1"], "rejected", "unknown_api_version: tools match no version"),
                Verdict(ids["tk-2"], "skipped", "no outcome reported"),
            ],
        )


def test_traces_list_and_show_explain_every_verdict(
    api_url: str, capsys: pytest.CaptureFixture[str], session_factory: SessionFactory
) -> None:
    loop = make_loop(capsys)
    seed(api_url, loop, session_factory)

    code, out, err = run(capsys, "traces", "list", "--loop", "helpdesk")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["EXTERNAL", "ID", "OUTCOME", "CURATION"]
    assert [line.split()[0] for line in lines[1:]] == ["tk-3", "tk-2", "tk-1", "tk-0"]
    assert "rejected" in lines[3] and lines[3].endswith("unknown_api_version")
    assert "pending" in lines[1]

    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--curation", "rejected", "--json")
    page = json.loads(out)
    assert {t["external_id"] for t in page["traces"]} == {"tk-0", "tk-1"}
    assert page["next_cursor"] is None

    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--limit", "3")
    assert code == 0 and "more: ratchet traces list --loop helpdesk --cursor " in out
    cursor = out.rsplit("--cursor ", 1)[1].strip()
    code, out, _ = run(capsys, "traces", "list", "helpdesk", "--limit", "3", "--cursor", cursor)
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["tk-0"]

    code, out, err = run(capsys, "traces", "list", "helpdesk", "--cursor", "bogus")
    assert code == 1 and "cursor" in err and "Traceback" not in err
    code, out, err = run(capsys, "traces", "list", "--loop", "nope")
    assert code == 1 and "there is no loop named 'nope'" in err

    code, out, err = run(capsys, "traces", "show", "tk-0", "--loop", "helpdesk")
    assert code == 0, err
    assert "curation     rejected (unknown_api_version)" in out
    assert "detail       unknown_api_version: tools match no version" in out
    code, out, _ = run(capsys, "traces", "show", "tk-0", "--loop", "helpdesk", "--json")
    assert json.loads(out)["reason"] == "unknown_api_version" and "body" not in json.loads(out)
    code, _, err = run(capsys, "traces", "show", "missing", "--loop", "helpdesk")
    assert code == 1 and "no trace with external_id 'missing'" in err


def test_loop_show_counts_traces_by_curation_outcome_and_reason(
    api_url: str, capsys: pytest.CaptureFixture[str], session_factory: SessionFactory
) -> None:
    loop = make_loop(capsys)
    seed(api_url, loop, session_factory)
    code, out, err = run(capsys, "loop", "show", "helpdesk")
    assert code == 0, err
    assert "       1  pending  (e.g. tk-3)" in out
    assert "       2  rejected unknown_api_version  (e.g. tk-1)" in out
    assert "       1  skipped no outcome reported  (e.g. tk-2)" in out


def test_a_loop_is_named_the_same_way_everywhere(
    api_url: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_DATABASE_URL", database_url)  # `tasks` reads Postgres
    get_settings.cache_clear()
    make_loop(capsys)
    by_name = run(capsys, "loop", "show", "helpdesk")
    by_option = run(capsys, "loop", "show", "--loop", "helpdesk")
    assert by_name[0] == by_option[0] == 0 and by_name[1] == by_option[1]
    code, _, err = run(capsys, "loop", "show", "helpdesk", "--loop", "other")
    assert code == 2 and "two loops named" in err
    code, _, err = run(capsys, "loop", "status")
    assert code == 2 and "name the loop: --loop NAME" in err
    for argv in (("tasks", "list", "--loop", "helpdesk"), ("tasks", "list", "helpdesk")):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "has no tasks yet" in out, (argv, err)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(capsys, "--version")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("ratchet 0.")


def test_first_hour_errors_say_what_to_do(
    api_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    code, _, err = run(capsys, "loop", "create", "x1", "--env", "nope", "--show-secrets")
    assert err == (
        "ratchet: error: invalid loop: environment: 'nope' is not installed; known: replay, "
        "toolcalc\n"
    )
    assert code == 1
    make_loop(capsys)
    missing = tmp_path / "no-such-checkpoint"
    code, _, err = run(capsys, "loop", "set-champion", "helpdesk", str(missing))
    assert code == 1
    assert f"checkpoint refused: {missing} is not a directory readable by the api" in err
    assert "see the error message" not in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "loop", "set-champion", "helpdesk", str(tmp_path / "empty"))
    assert code == 1 and "checkpoint rejected: " in err, err


def test_the_help_lists_every_loop_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(capsys, "--help")
    listed = " ".join(capsys.readouterr().out.split())
    for word in (
        "apply",
        "history",
        "export",
        "set or bootstrap the champion",
        "traces",
        "--version",
    ):
        assert word in listed, word


def test_traces_and_tasks_print_the_facts_a_task_checks(
    api_url: str, capsys: pytest.CaptureFixture[str], session_factory: SessionFactory
) -> None:
    loop = make_loop(capsys)
    seed(api_url, loop, session_factory)
    reference = "Order PT-1003 was lost; it has been refunded in full (€19.90)."
    task = ReplayEnvironment().task_from_trace(
        failing_trace(reference_answer=reference, metadata={})
    )
    assert isinstance(task, TaskSpec)
    with session_factory.begin() as session:
        trace = session.scalars(select(Trace).where(Trace.external_id == "tk-3")).one()
        row = Task(
            loop_id=trace.loop_id,
            content_hash="r" * 64,
            environment="replay",
            spec=task.to_dict(),
            cluster_id="c1",
            split="train",
        )
        session.add(row)
        session.flush()
        session.add(TaskSource(task_id=row.id, trace_id=trace.id, relation="origin"))
        task_id = row.id
    checks = "facts: code PT1003 (PT-1003) · number 19.9 EUR (€19.90)"

    code, out, err = run(capsys, "traces", "list", "helpdesk")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split()[0] == "tk-3" and lines[2].split() == ["checks", *checks.split()]
    code, out, err = run(capsys, "traces", "show", "tk-3", "--loop", "helpdesk")
    assert code == 0 and f"  checks       {checks}" in out, err
    code, out, err = run(capsys, "tasks", "show", str(task_id))
    assert code == 0 and f"checks            {checks}" in out, err
