"""The run page's sampler-mismatch card (issue 44 item 3): the rows a train job wrote to
metrics.json when another engine sampled its rollouts, read defensively (job output) and
rendered escaped."""

from __future__ import annotations

from services.dashboard.pages import MISMATCH_ROWS_SHOWN, MismatchRow, sampler_mismatch_rows
from services.dashboard.render import render

GRPO_ROW = {
    "where": "step 3",
    "tokens": 412,
    "k3": 0.00123,
    "max_ratio": 1.8,
    "truncated_fraction": 0.05,
    "served": "ab" * 32,
}


def test_rows_are_read_as_the_job_writes_them_and_others_are_left_out() -> None:
    rft_row = {"where": "rollouts 1", "tokens": 10, "k3": 0.5, "max_ratio": 3, "served": "x"}
    metrics = {
        "sampler_mismatch": [GRPO_ROW, rft_row, {"where": "bad", "k3": "high"}, "nonsense", None]
    }
    assert sampler_mismatch_rows(metrics) == [
        MismatchRow("step 3", 412, 0.00123, 1.8, 0.05, "ab" * 32),
        MismatchRow("rollouts 1", 10, 0.5, 3.0, None, "x"),
    ]
    assert sampler_mismatch_rows({}) == sampler_mismatch_rows(None) == []
    assert sampler_mismatch_rows({"sampler_mismatch": "not a list"}) == []
    many = {"sampler_mismatch": [{**GRPO_ROW, "where": f"step {i}"} for i in range(250)]}
    shown = sampler_mismatch_rows(many)
    assert len(shown) == MISMATCH_ROWS_SHOWN and shown[-1].where == "step 249"


def test_the_card_shows_each_row_and_escapes_what_the_job_wrote() -> None:
    evil = {**GRPO_ROW, "where": "<script>window.__xss=1</script>"}
    html = render(
        "_sampler_mismatch.html",
        sampler_mismatch=sampler_mismatch_rows({"sampler_mismatch": [GRPO_ROW, evil]}),
    )
    assert 'id="run-sampler-mismatch"' in html
    assert "<td>step 3</td><td>412</td><td>0.00123</td><td>1.800</td><td>5.0%</td>" in html
    assert "abababababab…" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert render("_sampler_mismatch.html", sampler_mismatch=[]).strip() == ""
