"""``ratchet loop ...``: loops, their ingest credentials, configuration, champion and
operator actions, one module per group of commands:

- :mod:`.credentials`: ``create``, ``rotate-secret``
- :mod:`.views`: ``list``, ``show``, ``status``, ``tools``
- :mod:`.config`: ``apply``, ``history``, ``export``
- :mod:`.actions`: ``set-champion``, ``start``, ``pause``, ``resume``, ``run-now``,
  ``approve``, ``reject``, ``rollback``
- :mod:`.bootstrap`: ``bootstrap`` (a first champion from the loop's successful traces)

The commands call the admin API at ``settings.api_base_url`` with ``RATCHET_ADMIN_TOKEN``
(services.cli.common.call_api); every failure a user can fix is one line (api unreachable,
wrong token, no such loop, name taken, invalid field).
"""

from __future__ import annotations

from typing import Any

from services.cli.common import command_group
from services.cli.loop import actions, bootstrap, config, credentials, views


def register(subparsers: Any) -> None:
    commands = command_group(
        subparsers,
        "loop",
        help="create, list, show loops; apply a loop file, its history and export; rotate "
        "secrets; set or bootstrap the champion; pause, resume, approve, rollback",
    )
    for group in (credentials, views, config, actions, bootstrap):
        group.register(commands)
