"""The one rule for model text leaving a model (services.chat.text), and its writers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from services.chat.text import (
    REPLACEMENT,
    JobJsonError,
    load_job_json,
    storable_json,
    utf8_json,
    valid_json,
    valid_text,
)
from services.evaluation.evaluator import TaskResult
from services.evaluation.probes import Probe, read_listed_probes, write_probes
from services.logs import JsonFormatter, TextFormatter
from services.training.episode_file import EpisodeRecord, parse_episode_lines
from services.training.tokenizer import ByteTokenizer

DECODED = ByteTokenizer().decode([*b"ok ", 0xF9, 0x00, 0xE2, 0x82])  # bad, NUL, truncated


def storable(text: str) -> bool:
    """What Postgres text and jsonb accept: UTF-8 without NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def test_lone_surrogates_and_nul_become_replacement_characters() -> None:
    assert not storable(DECODED)
    assert valid_text(DECODED) == "ok " + REPLACEMENT * 4
    assert storable(valid_text(DECODED))


def test_utf8_json_keeps_text_as_itself_and_escapes_only_what_utf8_cannot_encode() -> None:
    assert utf8_json({"t": "ü"}) == '{"t": "ü"}'.encode()
    assert utf8_json({"t": "ü"}, compact=True) == '{"t":"ü"}'.encode()
    escaped = utf8_json({"t": "ü\ud800"})  # a lone surrogate: all of it escaped, no error
    assert escaped == b'{"t": "\\u00fc\\ud800"}'
    assert json.loads(escaped) == {"t": "ü\ud800"}


def test_storable_json_replaces_nul_and_lone_surrogates_keys_too_and_leaves_clean_json() -> None:
    clean = {"a": ["ü", 1, None, {"b": 2.5}]}
    assert json.loads(storable_json(clean)) == clean
    dirty = {"k\x00": ["a\x00b", {"c": "\udcf9"}], "n": 3}
    stored = storable_json(dirty)
    assert storable(stored) and "\\u0000" not in stored
    assert json.loads(stored) == {
        f"k{REPLACEMENT}": [f"a{REPLACEMENT}b", {"c": REPLACEMENT}],
        "n": 3,
    }


def test_valid_text_is_left_alone_and_a_surrogate_pair_is_joined() -> None:
    assert valid_text("plain ü 😀") == "plain ü 😀"
    assert valid_text("\ud83d\ude00") == "😀"


def test_valid_json_cleans_keys_and_values_at_any_depth() -> None:
    value = {"a\udcff": [1, {"b": "x\udcf9"}, None, True, 2.5]}
    assert valid_json(value) == {f"a{REPLACEMENT}": [1, {"b": f"x{REPLACEMENT}"}, None, True, 2.5]}


def test_job_json_is_read_storable() -> None:
    raw = json.dumps({"answer": DECODED, DECODED: 1})
    assert "\\udcf9" in raw and "\\u0000" in raw
    assert load_job_json(raw) == {"answer": valid_text(DECODED), valid_text(DECODED): 1}
    assert load_job_json('{"a": "plain"}') == {"a": "plain"}


@pytest.mark.parametrize("raw", ['{"loss": NaN}', '{"loss": -Infinity}', "[1e999]"])
def test_job_json_refuses_numbers_json_has_not(raw: str) -> None:
    with pytest.raises(JobJsonError, match="finite"):
        load_job_json(raw)


def test_every_writer_of_model_text_writes_it_storable(tmp_path: Path) -> None:
    record = EpisodeRecord("t" * 64, True, 1.0, DECODED, [([1], [True])], None, "tiny")
    line = record.to_json()
    assert parse_episode_lines([line], where="x")[0].text == valid_text(DECODED)
    assert "\\udcf9" not in line and "\\u0000" not in line

    row = TaskResult("t", False, 0.0, {}, 1, answer=DECODED).to_dict()
    assert row["answer"] == valid_text(DECODED)
    assert "\\udcf9" not in json.dumps(row)

    probe = Probe("t", [{"role": "user", "content": "hi"}], [], 4, [1], [2], None, [-0.5], DECODED)
    listing = write_probes(tmp_path, "ck", [probe])
    assert "\\udcf9" not in (tmp_path / "probes.json").read_text()
    probes = read_listed_probes(tmp_path, {"probes": listing})
    assert probes is not None and probes.probes[0].text == valid_text(DECODED)


def test_log_lines_carry_model_text_storable() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "answer %s", (DECODED,), None)
    line = JsonFormatter().format(record)
    assert json.loads(line)["msg"] == "answer " + valid_text(DECODED)
    assert storable(TextFormatter().format(record))
