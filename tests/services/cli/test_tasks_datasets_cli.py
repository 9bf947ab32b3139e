"""``ratchet tasks`` and ``ratchet datasets`` through the admin API (a real api on a real
Postgres), as ``ratchet loop`` does: no command of theirs opens the database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.artifacts import ArtifactStore
from services.curation.snapshot import snapshot
from services.db.session import SessionFactory
from services.settings import get_settings
from tests.services.cli.support import run
from tests.services.curation.support import add_traces, curate_all, make_loop, trace_body
from tests.services.curation.test_snapshot import questions


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


def test_the_commands_need_no_database_setting(
    api_url: str, curated: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no RATCHET_DATABASE_URL at all, every command still answers: through the api."""
    monkeypatch.delenv("RATCHET_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    for argv in (
        ("tasks", "list", "cli-loop"),
        ("datasets", "list", "cli-loop"),
        ("datasets", "show", str(curated)),
    ):
        code, _, err = run(capsys, *argv)
        assert (code, err) == (0, ""), argv


def test_tasks_list_and_show(
    api_url: str, curated: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "tasks", "list", "--loop", "cli-loop", "--json")
    page = json.loads(out)
    assert code == 0 and page["next_cursor"] is None
    tasks = page["tasks"]
    assert len(tasks) == 4
    (heavy,) = [t for t in tasks if t["weight"] == 2]
    assert heavy["redactions"] == {"email": 1}
    code, table, _ = run(capsys, "tasks", "list", "--loop", "cli-loop")
    assert "cli-loop" not in table and "bob@example.com" not in table
    assert len(table.splitlines()) == 5
    code, shown, _ = run(capsys, "tasks", "show", str(heavy["id"]))
    assert code == 0 and "[REDACTED_EMAIL]" in shown and "bob@example.com" not in shown
    assert "origin" in shown and "duplicate" in shown and "dup" in shown
    code, out, _ = run(capsys, "tasks", "show", str(heavy["id"]), "--json")
    detail = json.loads(out)
    assert detail["loop"] == "cli-loop" and len(detail["sources"]) == 2


def test_tasks_list_pages_with_the_cursor(
    api_url: str, curated: int, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[int] = []
    cursor: list[str] = []
    while True:
        code, out, _ = run(capsys, "tasks", "list", "cli-loop", "--limit", "3", "--json", *cursor)
        page = json.loads(out)
        seen += [task["id"] for task in page["tasks"]]
        if page["next_cursor"] is None:
            break
        cursor = ["--cursor", page["next_cursor"]]
    assert len(seen) == 4 and seen == sorted(seen, reverse=True)
    code, out, _ = run(capsys, "tasks", "list", "cli-loop", "--limit", "3")
    assert "more: ratchet tasks list --loop cli-loop --cursor " in out
    code, _, err = run(capsys, "tasks", "list", "cli-loop", "--cursor", "bogus")
    assert code == 1 and "cursor" in err and len(err.strip().splitlines()) == 1


def test_datasets_list_show_export(
    api_url: str, curated: int, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "datasets", "list", "--loop", "cli-loop", "--json")
    (dataset,) = json.loads(out)["datasets"]
    assert dataset["id"] == curated
    code, out, _ = run(capsys, "datasets", "show", str(curated), "--json")
    shown = json.loads(out)
    assert shown["source_traces"] == 5 and shown["loop"] == "cli-loop"
    out_dir = tmp_path / "export"
    code, _, _ = run(capsys, "datasets", "export", str(curated), "--out", str(out_dir))
    assert code == 0
    assert {p.name for p in out_dir.iterdir()} == {
        "train.jsonl",
        "eval.jsonl",
        "regression.jsonl",
        "heldout.jsonl",
        "replay.jsonl",
        "manifest.json",
    }
    code, _, err = run(capsys, "datasets", "show", "999999")
    assert code == 1 and "there is no dataset 999999" in err


def test_pin_and_errors(api_url: str, curated: int, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tasks", "list", "--loop", "cli-loop", "--json")
    first = json.loads(out)["tasks"][0]["id"]
    code, out, _ = run(capsys, "tasks", "pin", "--loop", "cli-loop", str(first))
    assert code == 0 and out.startswith("pinned 1 task(s)")
    code, out, _ = run(capsys, "tasks", "list", "cli-loop", "--split", "regression", "--json")
    assert [t["id"] for t in json.loads(out)["tasks"]] == [first]

    code, _, err = run(capsys, "tasks", "list", "--loop", "nope")
    assert code == 1 and "there is no loop named 'nope'" in err and "ratchet loop list" in err
    code, _, err = run(capsys, "tasks", "show", "999999")
    assert code == 1 and "there is no task 999999" in err
    code, _, err = run(capsys, "tasks", "pin", "--loop", "cli-loop", str(first), "999999")
    assert code == 1 and "nothing was pinned" in err and "task_ids.1" in err
    with pytest.raises(SystemExit):
        run(capsys, "tasks", "show", "0")
