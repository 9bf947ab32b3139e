"""toolcalc as an OpenAI chat task with function tools, for chat models (the ``hf`` family).

The same task (same id, request and API version) is rendered as a conversation::

    system: You are a calculator agent. ... Prices are in US dollars (usd).
    user:   What is the price of one pear times 37?
    tools:  get(item), mul(a, b), add(a, b)      (v1; JSON-schema functions)
    assistant: <tool_call>{"name": "get", "arguments": {"item": "pear"}}</tool_call>
    tool:   12
    assistant: <tool_call>{"name": "mul", "arguments": {"a": 12, "b": 37}}</tool_call>
    tool:   444
    assistant: 444

The drift is the API's: v2 renames the functions (``plus``, ``times``, ``price``) and drops
the old names, v3 adds the required ``cur`` argument to the price lookup. A chat model sees
the current names in the tool list, so a rename hurts only a model that learned the old
names by heart instead of reading the list; the calls it makes with old names get
``error: unknown tool get`` back, as from a real API.

Arguments are JSON: integers for ``a``/``b`` (an integer-valued number or a string of
digits is accepted, as lenient APIs do), lower-case words for ``item`` and ``cur``. The
verifier re-parses the raw completions with the same parser and recomputes the answer from
the request: the rubric (syntax, tools, answer) and the pass rule are the text
environment's.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from typing import Any

from services.chat.protocol import ChatMessage, ToolCall
from services.chat.render import tool_call_text
from services.chat.toolcalls import parse_assistant_output
from services.environments.base import Reward
from services.environments.chat import ChatEpisode
from services.environments.toolcalc.api import CallError, ParsedCall, ToolAPI
from services.environments.toolcalc.tasks import Program

SYSTEM_PROMPT = (
    "Use the tools for every price, sum and product, one call at a time. Prices are in usd. "
    "Reply with the final number only."
)
WEIGHTS = {"syntax": 0.1, "tools": 0.2, "answer": 0.7}

_TERM = re.compile(r"^(\d+|\$[a-z]+)$")
_INT_TEXT = re.compile(r"^-?\d{1,9}$")
_WORD = re.compile(r"^[a-z]{1,16}$")
_NUMBER = re.compile(r"-?\d[\d,]*")


_CHAT_DESCRIPTIONS = {
    "add": "Add two integers.",
    "mul": "Multiply two integers.",
    "lookup": "Price of one item.",
}


def openai_tools(api: ToolAPI) -> list[dict[str, Any]]:
    """The API's tools as OpenAI function tools, described tersely.

    Terse because on CPU the prompt's length is the rollout's cost: every turn re-reads
    it. The schema (names, parameters, required, the currency enum) is the API's own.
    """
    tools = []
    for spec, tool in zip(api.tool_specs(), api.tools, strict=True):
        properties = {
            name: {k: v for k, v in schema.items() if k != "description"}
            for name, schema in spec["parameters"]["properties"].items()
        }
        function = {
            "name": spec["name"],
            "description": _CHAT_DESCRIPTIONS[tool.op],
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(tool.params),
            },
        }
        tools.append({"type": "function", "function": function})
    return tools


def user_message(request: str) -> str:
    """The request in words: ``$pear*37`` → "What is the price of one pear times 37?"."""
    for symbol, word in (("+", "plus"), ("*", "times")):
        if symbol in request:
            left, right = request.split(symbol, 1)
            return f"What is {_term(left)} {word} {_term(right)}?"
    return f"What is {_term(request)}?"


def _term(term: str) -> str:
    return f"the price of one {term[1:]}" if term.startswith("$") else term


_QUESTION = re.compile(r"(?i)^what is (.+?)\s*\?$")
_PRICE_WORDS = re.compile(r"the price of one ([a-z]{1,16})")
_INTEGER_WORDS = re.compile(r"-?\d{1,9}")


def request_from_words(text: str) -> str | None:
    """The request a :func:`user_message` asks for ("What is the price of one pear times
    37?" → ``$pear*37``), or None for any other text: a chat agent's trace carries the words,
    and curation rebuilds the task from them."""
    match = _QUESTION.match(" ".join(text.split()))
    if match is None:
        return None
    body = match.group(1).lower()
    for word, symbol in (("plus", "+"), ("times", "*")):
        parts = body.split(f" {word} ")
        if len(parts) == 2:
            left, right = _term_from_words(parts[0]), _term_from_words(parts[1])
            return None if left is None or right is None else f"{left}{symbol}{right}"
    return _term_from_words(body)


def _term_from_words(words: str) -> str | None:
    if price := _PRICE_WORDS.fullmatch(words):
        return f"${price.group(1)}"
    return words if _INTEGER_WORDS.fullmatch(words) else None


def start_messages(request: str) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content=SYSTEM_PROMPT),
        ChatMessage(role="user", content=user_message(request)),
    ]


def check_call(api: ToolAPI, call: ToolCall) -> ParsedCall | CallError:
    """A chat tool call checked against the API: typed arguments, or the error it gets."""
    tool = api.by_name(call.name)
    if tool is None:
        return CallError(f"error: unknown tool {call.name}", name=call.name)
    usage = CallError(
        f"error: usage {tool.name}({', '.join(tool.params)})",
        name=call.name,
        raw_args=json.dumps(call.arguments, sort_keys=True),
    )
    if set(call.arguments) != set(tool.params):
        return usage
    args: dict[str, Any] = {}
    for param in tool.params:
        value = call.arguments[param]
        if param in ("a", "b"):
            number = _as_int(value)
            if number is None:
                return usage
            args[param] = number
        elif not isinstance(value, str) or not _WORD.match(value.strip().lower()):
            return usage
        else:
            args[param] = value.strip().lower()
    return ParsedCall(tool=tool, args=args, name=call.name)


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) < 10**9 else None
    if isinstance(value, float) and value.is_integer() and abs(value) < 10**9:
        return int(value)
    if isinstance(value, str) and _INT_TEXT.match(value.strip()):
        return int(value.strip())
    return None


def apply_completion(
    api: ToolAPI,
    episode: ChatEpisode,
    completion: str,
    *,
    truncated: bool,
    execute: Any,
) -> None:
    """Record one assistant turn and answer its tool calls (``execute(ParsedCall)``)."""
    message = parse_assistant_output(completion)
    first = sum(len(m.tool_calls) for m in episode.messages)
    calls = tuple(
        replace(call, id=f"call_{first + i}") for i, call in enumerate(message.tool_calls)
    )
    episode.completions.append(completion)
    episode.truncated.append(truncated)
    episode.messages.append(replace(message, tool_calls=calls))
    if not calls:
        episode.done, episode.end_reason = True, "answered"
        return
    for call in calls:
        checked = check_call(api, call)
        result = checked.message if isinstance(checked, CallError) else execute(checked)[0]
        episode.messages.append(
            ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name)
        )
    if episode.assistant_turns >= episode.max_turns:
        episode.done, episode.end_reason = True, "max_turns"


def verify_completions(api: ToolAPI, program: Program, completions: list[str]) -> Reward:
    """The rubric from the raw completions alone (the answer is the last turn's number)."""
    parsed = [parse_assistant_output(text) for text in completions]
    calls = [check_call(api, call) for message in parsed for call in message.tool_calls]
    well_formed = [c for c in calls if isinstance(c, ParsedCall)]
    syntax = len(well_formed) / len(calls) if calls else 0.0
    required = Counter(program.calls)
    made = Counter((c.tool.op, tuple(c.args[p] for p in c.tool.params)) for c in well_formed)
    tools = sum((required & made).values()) / len(program.calls) if program.calls else 1.0
    final = parsed[-1] if parsed else None
    answer_text = final.content if final is not None and not final.tool_calls else None
    answer = 1.0 if extract_answer(answer_text) == program.answer else 0.0
    components = {"syntax": syntax, "tools": tools, "answer": answer}
    total = sum(WEIGHTS[k] * v for k, v in components.items())
    return Reward(components=components, total=round(total, 6), passed=answer == 1.0)


def extract_answer(content: str | None) -> int | None:
    """The last integer in a final answer ("The total is 1,234." → 1234), if any."""
    if not content:
        return None
    numbers = [n.replace(",", "") for n in _NUMBER.findall(content)]
    numbers = [n for n in numbers if re.fullmatch(r"-?\d{1,12}", n)]
    return int(numbers[-1]) if numbers else None


def demonstration_text(call: ToolCall) -> str:
    """How a demonstration writes a call: the Hermes ``<tool_call>`` block."""
    return tool_call_text(call.name, call.arguments)
