"""What the ``ratchet loop`` commands share: naming the loop, the api call, printing."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from services.cli.common import add_command, add_loop_argument, call_api, loop_name


def call(action: Callable[[Any], Any]) -> Any:
    """An admin API call of a loop command: a 422 reads ``invalid loop: FIELD: ...``."""
    return call_api(action, invalid="loop")


def loop_command(
    commands: Any, command: str, handler: Callable[[argparse.Namespace], int], *, help: str
) -> argparse.ArgumentParser:
    """A command about one loop: ``ratchet loop show NAME`` or ``... show --loop NAME``
    (services.cli.common.add_loop_argument); the handler reads ``args.name``."""
    parser = add_command(commands, command, handler, help=help)
    add_loop_argument(parser, positional=True)

    def named(args: argparse.Namespace) -> int:
        args.name = loop_name(args)
        return handler(args)

    parser.set_defaults(func=named)
    return parser


def print_model(value: BaseModel | list[BaseModel]) -> None:
    """What the api answered, as JSON (``--json``)."""
    if isinstance(value, list):
        print(json.dumps([item.model_dump(mode="json") for item in value], indent=2))
    else:
        print(json.dumps(value.model_dump(mode="json"), indent=2))


def print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"warning: {warning}")


def print_changes(changes: Any) -> None:
    from services.loop.config import Change, render_diff

    items = [c if isinstance(c, Change) else Change(c.path, c.before, c.after) for c in changes]
    for line in render_diff(items):
        print(line)
