"""toolcalc's tool APIs: three versions of the same three tools, drifting as real APIs do.

| version | add           | multiply       | price lookup        | drift                      |
|---------|---------------|----------------|---------------------|----------------------------|
| v1      | ``#add(a,b)`` | ``&mul(a,b)``  | ``@get(item)``      | —                          |
| v2      | ``#plus(a,b)``| ``&times(a,b)``| ``@price(item)``    | renamed; old names removed |
| v3      | ``#plus(a;b)``| ``&times(a;b)``| ``@price(item;cur)``| ``;`` between arguments,   |
|         |               |                |                     | ``cur`` a new required arg |

How the rename happened matters for a model trained on last month's traffic, so toolcalc
models the usual deprecation path: the new names were announced and accepted early (v1
accepts ``plus``, ``times``, ``price`` as unlisted aliases); then the listing switched to
the new names while the old ones kept working for a deprecation window
(:func:`deprecation_window`); v2 ends the window and drops them. Agents that kept the old
names through the window (most of them) break on v2; those that had migrated keep working.

The prompt lists the tools as ``tools: #add(a,b) &mul(a,b) @get(item)``. Each tool carries
a one-character *kind* sigil that never changes across versions (``#`` adds, ``&``
multiplies, ``@`` looks up a price): it is the tool's description in a form a byte-level
model can use, the stable part of an API whose names drift. The user's request uses the
arithmetic notation (``$pear*37``: the price of a pear times 37), so the sigils occur
exactly once in a prompt.

The agent writes a call the way the listing shows it, sigil first: ``@get(pear)``,
``&mul(12,37)``. The sigil is optional for the parser (``get(pear)`` is the same call) but
a wrong one is a usage error. Writing the sigil first makes "what is this tool called
now?" a lookup a small transformer learns quickly (an induction head: find the sigil in
the listing, copy what follows), whatever this API version calls the tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

Op = Literal["add", "mul", "lookup"]

CURRENCIES = ("usd", "eur")

_CALL = re.compile(r"^([#&@])?([A-Za-z_][A-Za-z0-9_]*)\((.*)\)$")
_INT = re.compile(r"^-?\d{1,9}$")
_WORD = re.compile(r"^[a-z]{1,16}$")


@dataclass(frozen=True)
class ToolDef:
    """One tool of one API version."""

    op: Op
    sigil: str
    name: str
    params: tuple[str, ...]
    description: str

    def signature(self, separator: str) -> str:
        return f"{self.sigil}{self.name}({separator.join(self.params)})"


@dataclass(frozen=True)
class ParsedCall:
    """A call that is well-formed for the API: the tool, the name used, typed arguments."""

    tool: ToolDef
    args: dict[str, Any]
    name: str


@dataclass(frozen=True)
class CallError:
    """A call that is not well-formed for the API, with the message the agent gets back."""

    message: str
    name: str | None = None
    raw_args: str | None = None


@dataclass(frozen=True)
class ToolAPI:
    """One version of the toolcalc API."""

    version: str
    tools: tuple[ToolDef, ...]
    separator: str = ","
    aliases: tuple[tuple[str, Op], ...] = ()  # unlisted names that are also accepted

    def by_name(self, name: str) -> ToolDef | None:
        """The tool called ``name``, by its listed name or an accepted alias."""
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            op = next((op for alias, op in self.aliases if alias == name), None)
            tool = self.by_op(op) if op is not None else None
        return tool

    def alias_of(self, op: Op) -> str | None:
        return next((alias for alias, alias_op in self.aliases if alias_op == op), None)

    def by_op(self, op: Op) -> ToolDef:
        return next(t for t in self.tools if t.op == op)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def listing(self) -> str:
        """The tool listing line the agent sees."""
        return "tools: " + " ".join(t.signature(self.separator) for t in self.tools)

    def tool_specs(self) -> list[dict[str, Any]]:
        """Tool specs (name, description, JSON-schema parameters), as a runtime publishes them."""
        specs = []
        for tool in self.tools:
            properties = {p: _param_schema(p) for p in tool.params}
            specs.append(
                {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": list(tool.params),
                    },
                }
            )
        return specs

    def format_call(self, op: Op, args: tuple[Any, ...], *, use_alias: bool = False) -> str:
        """A call as the agent writes it: the sigil, the name (or its alias), the arguments."""
        tool = self.by_op(op)
        name = (self.alias_of(op) if use_alias else None) or tool.name
        return f"{tool.sigil}{name}({self.separator.join(str(a) for a in args)})"

    def parse_call(self, text: str) -> ParsedCall | CallError | None:
        """A call for this API, a malformed call (with its error), or None when not call-shaped."""
        match = _CALL.match(text.strip())
        if match is None:
            return None
        sigil, name, raw = match.group(1), match.group(2), match.group(3)
        tool = self.by_name(name)
        if tool is None:
            return CallError(f"error: unknown tool {name}", name=name, raw_args=raw)
        usage = CallError(f"error: usage {tool.signature(self.separator)}", name=name, raw_args=raw)
        if sigil is not None and sigil != tool.sigil:
            return usage
        parts = [p.strip() for p in raw.split(self.separator)] if raw.strip() else []
        if len(parts) != len(tool.params):
            return usage
        args: dict[str, Any] = {}
        for param, value in zip(tool.params, parts, strict=True):
            if param in ("a", "b"):
                if not _INT.match(value):
                    return usage
                args[param] = int(value)
            elif not _WORD.match(value):
                return usage
            else:
                args[param] = value
        return ParsedCall(tool=tool, args=args, name=name)


def _param_schema(param: str) -> dict[str, Any]:
    if param in ("a", "b"):
        return {"type": "integer"}
    if param == "cur":
        return {"type": "string", "enum": list(CURRENCIES), "description": "currency of the price"}
    return {"type": "string", "description": "item name from the price table"}


def _tools(add: str, mul: str, lookup: str, lookup_params: tuple[str, ...]) -> tuple[ToolDef, ...]:
    return (
        ToolDef("add", "#", add, ("a", "b"), "add two integers (the + of a request)"),
        ToolDef("mul", "&", mul, ("a", "b"), "multiply two integers (the * of a request)"),
        ToolDef("lookup", "@", lookup, lookup_params, "price of an item (the $item of a request)"),
    )


_FORWARD_ALIASES: tuple[tuple[str, Op], ...] = (
    ("plus", "add"),
    ("times", "mul"),
    ("price", "lookup"),
)

TOOLCALC_APIS: dict[str, ToolAPI] = {
    "v1": ToolAPI("v1", _tools("add", "mul", "get", ("item",)), ",", _FORWARD_ALIASES),
    "v2": ToolAPI("v2", _tools("plus", "times", "price", ("item",)), ","),
    "v3": ToolAPI("v3", _tools("plus", "times", "price", ("item", "cur")), ";"),
}
TOOLCALC_API_VERSIONS: tuple[str, ...] = tuple(TOOLCALC_APIS)


def deprecation_window(old: str, new: str) -> ToolAPI:
    """``new``'s listing and syntax, still accepting ``old``'s names (the migration period)."""
    old_api, new_api = get_api(old), get_api(new)
    aliases = tuple((t.name, t.op) for t in old_api.tools if new_api.by_name(t.name) is None)
    return ToolAPI(f"{new}-window", new_api.tools, new_api.separator, aliases)


def get_api(version: str) -> ToolAPI:
    try:
        return TOOLCALC_APIS[version]
    except KeyError:
        known = ", ".join(TOOLCALC_API_VERSIONS)
        raise ValueError(f"unknown toolcalc API version {version!r} (known: {known})") from None


def infer_api_version_from_specs(specs: list[dict[str, Any]]) -> str | None:
    """Infer the API version from tool specs: names first, then the price tool's parameters."""
    names = frozenset(str(s.get("name")) for s in specs)
    candidates = [v for v, api in TOOLCALC_APIS.items() if api.names == names]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    for version in candidates:
        api = TOOLCALC_APIS[version]
        lookup = api.by_op("lookup")
        spec = next((s for s in specs if s.get("name") == lookup.name), {})
        params = spec.get("parameters")
        properties = params.get("properties") if isinstance(params, dict) else None
        if isinstance(properties, dict) and set(properties) == set(lookup.params):
            return version
    return None
