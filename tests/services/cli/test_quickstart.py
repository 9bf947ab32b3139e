"""docs/quickstart.md, followed as a reader follows it: its shell and Python blocks run as
written against a real api and Postgres, then its commands read every trace back with its
curation outcome, and the loop page shows what became of them.

What the test does not take from the doc: section 1 (`pip install`, `ratchet up`: the test
serves the api itself, and curates once where `ratchet up`'s worker would, with the same
pipeline), `source .venv/bin/activate` and `pip install ./clients/python` (the test puts
`ratchet` and the light client on the paths), section 7 (the SmolLM2 champion needs the hf
extra and its wheel), the api's address (a free port instead of 127.0.0.1:8000) and the
secret, which it reads from `ratchet loop create`'s output as the reader copies it.

Until the ``replay`` environment is installed, the loop is a ``toolcalc`` loop (the doc's
``replay`` replaced) and the traces are expected back as rejected with their reason; with
``replay``, the doc runs unchanged and every trace must become a task on the loop page.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.db.session import SessionFactory
from services.environments.registry import environment_names
from tests.services.api.support import ADMIN, curate_once

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "quickstart.md"
DOC_URL = "http://127.0.0.1:8000"
TRACES = ("first-1", "first-2", "first-3")


def sections() -> dict[str, list[tuple[str, str]]]:
    """The doc's fenced blocks, ``(language, text)``, by the number of their ``##`` section."""
    found: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        number = part.split(".", 1)[0]
        found[number] = re.findall(r"```(\w+)\n(.*?)```", part, flags=re.S)
    return found


def blocks(section: str, language: str) -> list[str]:
    return [text for lang, text in sections()[section] if lang == language]


@pytest.fixture
def shell_env(api_url: str, tmp_path: Path) -> dict[str, str]:
    """`ratchet` on PATH (this checkout) and the light client importable, as after section 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ratchet = bin_dir / "ratchet"
    ratchet.write_text(f'#!/bin/sh\nexec {sys.executable} -m services "$@"\n')
    ratchet.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'clients' / 'python' / 'src'}"
    env["RATCHET_STATE_DIR"] = str(tmp_path / "state")
    return env


def as_written(text: str, api_url: str, replay: bool) -> str:
    """A block as the reader runs it here: this api's address, and toolcalc until replay."""
    text = text.replace(DOC_URL, api_url)
    if not replay:
        text = text.replace("--env replay", "--env toolcalc")
        text = text.replace("environment: replay", "environment: toolcalc")
    return text


def bash(script: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def test_the_quickstart_verbatim(
    api_url: str, shell_env: dict[str, str], session_factory: SessionFactory, tmp_path: Path
) -> None:
    replay = "replay" in environment_names()
    work = tmp_path / "work"
    work.mkdir()

    # 2. Create a loop: the create command, the secret copied from its output.
    [create, export, apply] = blocks("2", "bash")
    create = "\n".join(line for line in create.splitlines() if not line.startswith("source "))
    created = bash(as_written(create, api_url, replay), shell_env, work)
    [secret] = re.findall(r"whsec_[A-Za-z0-9+/=]+", created)
    assert "whsec_..." in export
    export = export.replace("whsec_...", secret)
    [loop_file] = blocks("2", "yaml")
    (work / "myloop.yaml").write_text(as_written(loop_file, api_url, replay))
    applied = bash(as_written(apply, api_url, replay), shell_env, work)
    assert "version" in applied

    # 3. Connect your agent (the gateway) is tests/services/gateway's.
    # 4. Post a trace with curl (in the shell where SECRET was exported).
    [curl, *_] = blocks("4", "bash")
    posted = bash(export + as_written(curl, api_url, replay), shell_env, work)
    assert '"accepted":1' in posted, posted

    # 5. Post from Python, with feedback.
    [client_code] = blocks("5", "python")
    script = work / "post.py"
    script.write_text(as_written(client_code, api_url, replay).replace("whsec_...", secret))
    done = subprocess.run(
        [sys.executable, str(script)], env=shell_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "accepted=2" in done.stdout and "status='accepted'" in done.stdout, done.stdout

    # 6. See what became of each trace (after the pass the worker makes within seconds).
    curate_once(session_factory, "myloop")
    [see] = blocks("6", "bash")
    shown = bash(as_written(see, api_url, replay), shell_env, work)
    for external_id in TRACES:
        assert external_id in shown
    # `ratchet loop show` says what the next cycle waits for, in the doc's words.
    [waits_for] = [text for lang, text in sections()["6"] if lang == "text"]
    for line in waits_for.splitlines():
        assert line.strip() in shown, f"{line.strip()!r} not in:\n{shown}"
    listing = httpx.get(f"{api_url}/v1/loops/myloop/traces", headers=ADMIN, timeout=30).json()
    verdicts = {t["external_id"]: t for t in listing["traces"]}
    assert set(verdicts) == set(TRACES)
    page = httpx.get(f"{api_url}/loops/myloop", timeout=30).text
    assert 'id="curation-table"' in page
    if replay:
        for external_id in TRACES:
            assert verdicts[external_id]["curation_outcome"] == "task", verdicts[external_id]
        assert 'data-outcome="task"' in page
        assert 'class="cluster"' in page, "the loop page shows no curated task"
        assert "No tasks curated yet" not in page
    else:
        for external_id in TRACES:
            verdict = verdicts[external_id]
            assert verdict["curation_outcome"] == "rejected" and verdict["reason"], verdict
            assert (
                f"curation     rejected ({verdict['reason']})" in shown or external_id != "first-1"
            )
        assert 'data-outcome="rejected"' in page
