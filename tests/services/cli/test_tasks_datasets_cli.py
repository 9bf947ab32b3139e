"""``ratchet tasks`` and ``ratchet datasets`` against a real Postgres."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.artifacts import ArtifactStore
from services.cli import CliError
from services.cli import datasets as datasets_cli
from services.cli import tasks as tasks_cli
from services.curation.snapshot import snapshot
from services.db.session import SessionFactory
from services.settings import get_settings
from tests.services.curation.support import add_traces, curate_all, make_loop, trace_body
from tests.services.curation.test_snapshot import questions


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[argparse.ArgumentParser]:
    monkeypatch.setenv("RATCHET_DATABASE_URL", database_url)
    get_settings.cache_clear()
    parser = argparse.ArgumentParser(prog="ratchet")
    subparsers = parser.add_subparsers(dest="command")
    tasks_cli.register(subparsers)
    datasets_cli.register(subparsers)
    yield parser
    get_settings.cache_clear()


def run(parser: argparse.ArgumentParser, *argv: str) -> int:
    args = parser.parse_args(list(argv))
    return int(args.func(args))


@pytest.fixture
def curated(session_factory: SessionFactory, tmp_path: Path) -> int:
    loop_id = make_loop(session_factory, name="cli-loop", curation_policy={"heldout_fraction": 0.0})
    texts = questions(4, seed=3)
    add_traces(
        session_factory,
        loop_id,
        [
            trace_body(f"t{i}", f"{text} bob@example.com", answer=str(i))
            for i, text in enumerate(texts)
        ]
        + [trace_body("dup", f"{texts[0]} bob@example.com", answer="0")],
    )
    curate_all(session_factory, loop_id)
    return snapshot(session_factory, ArtifactStore(tmp_path / "a"), loop_name="cli-loop").dataset_id


def test_tasks_list_and_show(
    cli: argparse.ArgumentParser, curated: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(cli, "tasks", "list", "--loop", "cli-loop", "--json") == 0
    tasks = json.loads(capsys.readouterr().out)
    assert len(tasks) == 4
    (heavy,) = [t for t in tasks if t["weight"] == 2]
    assert heavy["redactions"] == {"email": 1}
    assert run(cli, "tasks", "list", "--loop", "cli-loop") == 0
    table = capsys.readouterr().out
    assert "cli-loop" not in table and "bob@example.com" not in table
    assert len(table.splitlines()) == 5
    assert run(cli, "tasks", "show", str(heavy["id"])) == 0
    shown = capsys.readouterr().out
    assert "[REDACTED_EMAIL]" in shown and "bob@example.com" not in shown
    assert "origin" in shown and "duplicate" in shown and "dup" in shown


def test_datasets_list_show_export(
    cli: argparse.ArgumentParser, curated: int, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(cli, "datasets", "list", "--loop", "cli-loop", "--json") == 0
    (dataset,) = json.loads(capsys.readouterr().out)
    assert dataset["id"] == curated
    assert run(cli, "datasets", "show", str(curated), "--json") == 0
    assert json.loads(capsys.readouterr().out)["source_traces"] >= 1
    out = tmp_path / "export"
    assert run(cli, "datasets", "export", str(curated), "--out", str(out)) == 0
    assert {p.name for p in out.iterdir()} == {
        "train.jsonl",
        "eval.jsonl",
        "regression.jsonl",
        "manifest.json",
    }


def test_pin_and_errors(
    cli: argparse.ArgumentParser, curated: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(cli, "tasks", "list", "--loop", "cli-loop", "--json") == 0
    first = json.loads(capsys.readouterr().out)[0]["id"]
    assert run(cli, "tasks", "pin", "--loop", "cli-loop", str(first)) == 0
    assert capsys.readouterr().out.startswith("pinned 1 task(s)")
    assert run(cli, "tasks", "list", "--loop", "cli-loop", "--split", "regression", "--json") == 0
    assert [t["id"] for t in json.loads(capsys.readouterr().out)] == [first]
    with pytest.raises(CliError, match="no loop named 'nope'"):
        run(cli, "tasks", "list", "--loop", "nope")
    with pytest.raises(CliError, match="no task 999999"):
        run(cli, "tasks", "show", "999999")
    with pytest.raises(CliError, match="nothing was pinned"):
        run(cli, "tasks", "pin", "--loop", "cli-loop", "999999")
    with pytest.raises(SystemExit):
        run(cli, "tasks", "show", "0")
