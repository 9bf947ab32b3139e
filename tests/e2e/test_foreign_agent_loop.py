"""The foreign-agent benchmark's path, short, end to end: a domain Ratchet did not write (the
bookshop support agent of ``examples/support-agent``, a few dozen of its generated traces
and their later feedback) posted to a replay loop whose deployment lists the example's stdio
MCP server as a tool endpoint; the loop curates the traces (free-text references scored by
the facts rule) and has no champion; ``ratchet loop bootstrap`` over a base model trains an
SFT-LoRA adapter on the train split's successes and takes it through the auto gate, with the
base model as the baseline, on the frozen held-out set, where the calls nobody recorded go
to the MCP server and its answers join the loop's tool-response store.

The base model is the tiny random Llama of ``tests/services/training/hf_support.py``, taught
one tool call first: a random model never writes a valid call, so its tokenizer holds the
call ``check_stock("<a title no trace asked about>")`` as one added token and a few SFT
steps make the model answer every turn with it. What is under test is the stack, not the
model: every other part is real (embedded Postgres and Temporal, ``ratchet api`` and
``ratchet worker`` processes, the local executor's jobs, the MCP SDK's stdio server and
client). The assertions read Postgres rows and job files.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ratchet_client import TraceClient
from sqlalchemy import func, select

from benchmarks.foreign_traffic import EXAMPLE, Traffic, example_traffic
from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.client import LoopPolicies
from services.db.models import Cycle, Evaluation, Loop, Promotion, Run, Task, ToolResponse, Trace
from services.environments import read_task_file
from services.environments.replay.env import ReplayEnvironment
from tests.e2e.support import LiveStack, cycle_closed, wait_for

pytestmark = pytest.mark.slow

LOOP = "bookshop"
SEED = 3
TRACES = 40
ENDPOINT = "bookshop-tools"
SHOP_TOOLS = ["check_stock", "find_order", "refund_order", "track_parcel"]
TRAINING_PROFILE: dict[str, Any] = {
    "family": "hf",
    "algorithm": "rft",
    "device": "cpu",
    "hyperparameters": {"samples_per_task": 2, "max_turns": 2, "max_new_tokens": 8, "threads": 1},
    "bootstrap": {
        "hyperparameters": {
            "steps": 2,
            "batch_size": 2,
            "micro_batch": 2,
            "lora_r": 4,
            "log_every": 0,
            "threads": 1,
        }
    },
}
CURATION_POLICY = {
    "eval_fraction": 0.2,
    "heldout_fraction": 0.3,
    "success_sample_rate": 0.0,
    "tool_endpoint": ENDPOINT,
}
GATE_POLICY = {"mode": "auto", "eval_samples": 1, "eval_temperature": 0.0, "canary_seconds": 0}
TRIGGER_POLICY = {"min_new_tasks": 1000, "check_interval_s": 1, "drift_enabled": False}
TEACHING_STEPS = 30


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveStack]:
    """The live stack of tests/e2e/conftest.py, its deployment listing the bookshop's MCP
    server (``RATCHET_TOOL_ENDPOINTS``) with all four tools allow-listed."""
    for key in [key for key in os.environ if key.startswith("RATCHET_")]:
        monkeypatch.delenv(key)
    stack = LiveStack.in_dir(tmp_path / "state")
    command = [sys.executable, str(EXAMPLE / "mcp_server.py"), "--seed", str(SEED)]
    endpoints = {ENDPOINT: {"kind": "mcp", "command": command, "tools": SHOP_TOOLS}}
    stack.stack.extra_env["RATCHET_TOOL_ENDPOINTS"] = json.dumps(endpoints)
    try:
        with stack.diagnostics():
            stack.start()
        yield stack
    finally:
        stack.stop()


def test_a_foreign_agents_traces_bootstrap_through_the_gate_with_live_tools(
    live: LiveStack, tmp_path: Path
) -> None:
    month = example_traffic(tmp_path / "traffic", seed=SEED, count=TRACES)
    title, answer = _a_title_nobody_asked_about(month)
    base_dir = tmp_path / "base"
    _tiny_llama_that_calls(base_dir, call=_stock_call(title), traces=month.traces)
    base_id = install_checkpoint(base_dir, ArtifactStore(live.settings.artifacts_dir)).checkpoint_id
    with live.diagnostics(), live.client() as client:
        created = client.create_loop(
            LOOP,
            "replay",
            policies=LoopPolicies(
                serving_target={"kind": "none"},
                training_profile={**TRAINING_PROFILE, "base_checkpoint": base_id},
                gate_policy=GATE_POLICY,
                trigger_policy=TRIGGER_POLICY,
                curation_policy=CURATION_POLICY,
            ),
        )
        client.start_loop(LOOP)
        _post(live, created.signing_secret, month)
        wait_for(_all_curated(live), timeout=300, interval=1, what="the traces curated")

        plan = client.bootstrap(LOOP, reason="the foreign agent's first champion")
        assert plan["status"] == "signalled" and plan["base_checkpoint_id"] == base_id
        assert plan["report"]["used"] > 0 and plan["heldout_tasks"] > 0
        cycle = wait_for(cycle_closed(live, LOOP), timeout=900, interval=1, what="the bootstrap")

    # The bootstrap went through the gate with the base model as its baseline.
    assert cycle.trigger == "bootstrap"
    assert cycle.outcome in ("promoted", "rejected"), cycle.outcome_detail
    assert cycle.trigger_detail["bootstrap"]["base_checkpoint"] == base_id
    with live.sessions()() as session:
        promotion = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).one()
        evaluations = session.scalars(
            select(Evaluation).where(Evaluation.cycle_id == cycle.id)
        ).all()
    assert promotion.decision == ("promote" if cycle.outcome == "promoted" else "reject")
    assert promotion.statistics["baseline"] == "base_model"
    assert promotion.candidate_checkpoint_id == cycle.candidate_checkpoint_id != base_id
    assert {(e.checkpoint_id, e.task_set) for e in evaluations} == {
        (base_id, "heldout"),
        (cycle.candidate_checkpoint_id, "heldout"),
    }
    _assert_the_facts_rule_scores(live, cycle, month)
    _assert_the_unrecorded_call_reached_the_server(live, cycle, title=title, answer=answer)


def _assert_the_facts_rule_scores(live: LiveStack, cycle: Cycle, month: Traffic) -> None:
    """Every task of the loop is scored by the facts of its free-text reference (the rule
    free text gets by default), and a paraphrased success the bootstrap learnt from passes
    its own task's check: the same facts, other words."""
    with live.sessions()() as session:
        specs = session.scalars(
            select(Task.spec).join(Loop, Loop.id == Task.loop_id).where(Loop.name == LOOP)
        ).all()
        train = session.scalars(select(Run).where(Run.cycle_id == cycle.id, Run.kind == "train"))
        dataset = Path(train.one().spec["dataset"])
        external_ids = {i: e for i, e in session.execute(select(Trace.id, Trace.external_id))}
    assert specs
    assert {spec["verifier"]["params"]["reward"]["match"]["rule"] for spec in specs} == {"facts"}

    scenarios = {t["external_id"]: t["metadata"]["scenario"] for t in month.traces}
    demonstrations = read_task_file(dataset)
    paraphrased = [
        task
        for task in demonstrations
        if scenarios[external_ids[task.metadata["ratchet"]["source_traces"][0]]] == "paraphrase"
    ]
    assert paraphrased, "no paraphrased success among the bootstrap's demonstrations"
    task = paraphrased[0]
    assert task.verifier["params"]["reward"]["match"]["rule"] == "facts"
    env = ReplayEnvironment()
    turns = env.chat_demonstration(task)
    episode = env.chat_start(task, max_turns=len(turns))
    for _, text in turns:
        env.chat_step(task, episode, text)
    answer = turns[-1][1]
    assert answer != task.reference_answer  # worded otherwise ...
    assert env.chat_verify(task, episode).passed  # ... and right


def _assert_the_unrecorded_call_reached_the_server(
    live: LiveStack, cycle: Cycle, *, title: str, answer: str
) -> None:
    """The base model's evaluation called ``check_stock(title)``, which no trace recorded:
    the MCP server answered it, and the worker put the answer into the loop's store."""
    with live.sessions()() as session:
        base_eval = session.get(Run, f"{LOOP}-c{cycle.number}-eval-base-heldout")
        stored = session.scalars(
            select(ToolResponse)
            .join(Loop, Loop.id == ToolResponse.loop_id)
            .where(Loop.name == LOOP, ToolResponse.tool == "check_stock")
        ).all()
        recorded_by_traces = session.scalar(
            select(func.count())
            .select_from(ToolResponse)
            .where(ToolResponse.tool == "check_stock", ToolResponse.trace_id.is_not(None))
        )
    assert base_eval is not None and base_eval.status == "succeeded"
    usage = base_eval.metrics["tool_endpoints"][ENDPOINT]
    assert usage["calls"] >= 1 and usage["answered"] >= 1 and usage["failed"] == 0
    assert base_eval.metrics["tool_answers"]["count"] >= 1
    live_answers = [r for r in stored if r.trace_id is None]
    assert [json.loads(r.arguments) for r in live_answers] == [{"title": title}]
    assert live_answers[0].result == answer
    assert recorded_by_traces  # the traces' own check_stock calls are there beside it
    assert all(json.loads(r.arguments) != {"title": title} for r in stored if r.trace_id)


# -- the inputs ------------------------------------------------------------------------------


def _shop() -> Any:
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    from bookshop import CATALOGUE, Shop

    return Shop(SEED), CATALOGUE


def _a_title_nobody_asked_about(month: Traffic) -> tuple[str, str]:
    """A catalogue title no trace called ``check_stock`` with, and the shop's answer."""
    shop, catalogue = _shop()
    asked = {
        call["arguments"].get("title")
        for trace in month.traces
        for message in trace["messages"]
        for call in message.get("tool_calls") or ()
        if call["name"] == "check_stock"
    }
    title = min((t for t, _ in catalogue if t not in asked), key=len)
    answer = shop.call("v1", "check_stock", {"title": title})
    assert "error" not in json.loads(answer), answer
    return title, str(answer)


def _stock_call(title: str) -> str:
    from services.chat.render import tool_call_text

    return tool_call_text("check_stock", {"title": title})


def _tiny_llama_that_calls(out_dir: Path, *, call: str, traces: list[dict[str, Any]]) -> None:
    """hf_support's tiny random Llama whose tokenizer holds ``call`` as one added token,
    trained until it answers the bookshop's prompts (a first turn, and a turn after a tool
    result) with that token and the end of its turn; checked on prompts it never saw."""
    import torch
    from tokenizers import AddedToken
    from transformers import LlamaForCausalLM

    from services.training.hf.checkpoint import save_hf_checkpoint
    from services.training.hf.model import HFModel
    from tests.services.training.hf_support import build_tokenizer, tiny_llama_config

    tokenizer: Any = build_tokenizer()
    tokenizer.add_tokens([AddedToken(call, special=False, normalized=False)])
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=2048))
    policy = HFModel(model, tokenizer, device=torch.device("cpu"))
    target = [*policy.encode(call), policy.end_of_turn_id]
    assert len(target) == 2
    windows = [policy.encode(p)[-96:] for p in _prompts(policy, traces[:8], call)]
    inputs = torch.tensor([w + target for w in windows])
    labels = torch.tensor([[-100] * len(w) + target for w in windows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(TEACHING_STEPS):
        model(input_ids=inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    for prompt in _prompts(policy, traces[-4:], call):
        ids = torch.tensor([policy.encode(prompt)])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=target[-1])
        assert out[0, ids.shape[1] :].tolist() == target, "the tiny model did not learn its call"
    save_hf_checkpoint(model, tokenizer, out_dir, metadata={"model": "tiny-llama-one-call"})


def _prompts(policy: Any, traces: list[dict[str, Any]], call: str) -> list[str]:
    """Each trace's first prompt as the replay environment renders it, and the prompt after
    ``call`` got a tool result."""
    env = ReplayEnvironment()
    prompts = []
    for trace in traces:
        task = env.task_from_trace({**trace, "ratchet": {"policy": {}, "feedback": None}})
        episode = env.chat_start(task)  # type: ignore[arg-type]
        messages = [m.to_openai() for m in episode.messages]
        result = {"role": "tool", "tool_call_id": "c0", "name": "check_stock", "content": "{}"}
        prompts.append(policy.render(messages, episode.tools))
        prompts.append(
            policy.render(
                [*messages, {"role": "assistant", "content": call}, result], episode.tools
            )
        )
    return prompts


def _post(live: LiveStack, secret: str, month: Traffic) -> None:
    """The month through the signed webhook, then the verdicts that came later."""
    with TraceClient(live.api_url, LOOP, secret) as traces:
        posted = traces.post(month.traces)
        assert posted.accepted == len(month.traces)
        for external_id, verdict in month.feedback.items():
            traces.feedback(
                external_id,
                score=verdict.get("score"),
                label=verdict.get("label"),
                correction=verdict.get("correction"),
            )


def _all_curated(live: LiveStack) -> Any:
    def check() -> None:
        with live.sessions()() as session:
            waiting = session.scalar(
                select(func.count()).select_from(Trace).where(Trace.curated_at.is_(None))
            )
        assert waiting == 0, f"{waiting} traces not curated yet"

    return check
