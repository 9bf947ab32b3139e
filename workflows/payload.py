"""How a payload dataclass carries a loop's policies typed: one transfer type converter.

A loop's policies are pydantic models (``services.loop.policies``); Temporal's default JSON
converter knows dataclasses but not pydantic v2 models (it would fall back to pydantic v1's
deprecated ``dict``/``parse_obj`` and validate a recorded payload as if an operator had just
typed it). A dataclass decorated with :func:`policy_payload` is written as JSON with each
policy as its ``model_dump(mode="json")`` and read back with each policy validated as
*recorded* (``RECORDED``: a fact of the history, not re-checked against a later release's
stricter rules). The JSON is the same object a ``dict[str, Any]`` field of the older payload
held, so committed histories and running workflows read either way. Everything else in the
dataclass goes through Temporal's own ``value_to_type``, as the default converter does.

The converter is found on the class of the top-level value (Temporal looks no deeper), so
every dataclass that holds a policy, or holds one that does, is decorated; the payload test
(tests/workflows/test_payload_types.py) checks it.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel
from temporalio.converter import (
    TransferTypeConverter,
    transfer_type_convertible,
    value_to_type,
)

from services.loop.policies import RECORDED

T = TypeVar("T")


class PolicyPayload(TransferTypeConverter[Any, dict[str, Any]]):
    """A dataclass payload as a JSON object, its pydantic fields dumped and validated."""

    transfer_type: type[dict[str, Any]] | None = dict

    def to_transfer_type(self, value: Any) -> dict[str, Any]:
        dumped = dump_value(value)
        if not isinstance(dumped, dict):
            raise TypeError(f"{type(value).__name__} is not a dataclass payload")
        return dumped

    def from_transfer_type(self, value: dict[str, Any], type_hint: type[Any]) -> Any:
        return load_dataclass(type_hint, value)


# Every class marked with :func:`policy_payload`, for the payload test.
_MARKED: set[type[Any]] = set()


def policy_payload(
    converter: type[PolicyPayload] = PolicyPayload,
) -> Callable[[type[T]], type[T]]:
    """Mark a payload dataclass that holds a policy (see the module docstring); a class with
    an older shape to read as well passes its subclass of :class:`PolicyPayload`."""

    def mark(cls: type[T]) -> type[T]:
        _MARKED.add(cls)
        return transfer_type_convertible(converter)(cls)

    return mark


def has_policy_payload(cls: type[Any]) -> bool:
    """Whether ``cls`` is written and read by :class:`PolicyPayload` (or a subclass)."""
    return cls in _MARKED


def dump_value(value: Any) -> Any:
    """A payload value as JSON-ready data: policies dumped, dataclasses walked field by field."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [dump_value(item) for item in value]
    if isinstance(value, dict):
        return {key: dump_value(item) for key, item in value.items()}
    return value


def load_dataclass(cls: type[T], raw: dict[str, Any]) -> T:
    """``cls`` from its JSON object: keys it does not declare are dropped and a missing field
    takes its default, as Temporal's default converter reads a dataclass."""
    hints = get_type_hints(cls)
    values = {
        f.name: load_value(hints[f.name], raw[f.name])
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and f.name in raw
    }
    return cls(**values)


def load_value(hint: Any, value: Any) -> Any:
    """One field's value as its declared type (a policy validated as recorded)."""
    if value is None:
        return None
    model = policy_class(hint)
    if model is not None:
        return model.model_validate(value, context=RECORDED)
    target = _optional_arg(hint)
    if isinstance(target, type) and dataclasses.is_dataclass(target) and isinstance(value, dict):
        return load_dataclass(target, value)
    return value_to_type(hint, value)


def policy_class(hint: Any) -> type[BaseModel] | None:
    """The pydantic model a field declares (``ServingTarget`` or ``ServingTarget | None``)."""
    target = _optional_arg(hint)
    if isinstance(target, type) and issubclass(target, BaseModel):
        return target
    return None


def _optional_arg(hint: Any) -> Any:
    """``X`` of ``X | None``; any other hint unchanged."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
