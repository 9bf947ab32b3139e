"""The serving ledger's samples: a loop's server counters added to the open tenure of the
version it serves (services.loop.ledger does the arithmetic).

A sample is taken after every verified deploy, at every cycle's close and, between them, by
the ``sample_serving_ledgers`` activity the ledger's schedule runs (workflows/ledger.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from temporalio import activity

from services.db.queries.loops import require_loop
from services.db.queries.serving_ledger import record_sample, serving_loop_names
from services.db.session import SessionFactory
from services.loop.ledger import ServingLedger
from services.loop.policies import ServingTarget
from services.modelserver.usage import UsageUnavailable, VersionUsage
from services.serving.base import ServingError
from workflows.activities.transactions import serving_mapping, transaction, utcnow
from workflows.payloads.ledger import ServingLedgerInput, ServingLedgerResult

logger = logging.getLogger(__name__)


class ServingSampler:
    """Takes one sample of a loop's serving counters; the deploy and cycle activities share
    it (it is no activity itself)."""

    def __init__(self, session_factory: SessionFactory, ledger: ServingLedger | None) -> None:
        """``ledger``: where the serving ledger's samples are read (None: not kept)."""
        self._sessions = session_factory
        self._ledger = ledger

    def sample(
        self,
        loop_name: str,
        served_version: str | None,
        serving_target: ServingTarget | None = None,
    ) -> bool:
        """Add a sample of the serving target's counters to the loop's open tenure, and end
        it when ``served_version`` replaces it (services.loop.ledger). ``serving_target``:
        the one just deployed to (default: the loop's). An unreadable server is logged, not
        raised: a deploy or a cycle never fails for the ledger's sake. True when the
        counters were read (or there is nothing to read)."""
        if self._ledger is None:
            return True
        config = serving_mapping(serving_target) if serving_target is not None else None
        if config is None:
            with transaction(self._sessions) as session:
                loop = require_loop(session=session, name=loop_name)
                config = dict(loop.serving_target or {})
        if config.get("kind") == "none":
            return True
        usage: Mapping[str, VersionUsage] | None
        try:
            usage = self._ledger.read(config)
        except (UsageUnavailable, ServingError) as exc:
            logger.warning("loop %s: serving ledger sample skipped: %s", loop_name, exc)
            usage = None
        with transaction(self._sessions) as session:
            loop = require_loop(session=session, name=loop_name, for_update=True)
            record_sample(
                session=session,
                loop=loop,
                served_version=served_version,
                usage=usage,
                now=utcnow(),
                prices=self._ledger.prices,
            )
        return usage is not None


class ServingLedgerActivities:
    """The ledger's scheduled sample of every serving loop."""

    def __init__(self, session_factory: SessionFactory, sampler: ServingSampler) -> None:
        self._sessions = session_factory
        self._sampler = sampler

    @activity.defn(name="sample_serving_ledgers")
    def sample_serving_ledgers(self, input: ServingLedgerInput) -> ServingLedgerResult:
        """Between deploys: every loop that serves (not archived, a serving target) gets its
        server's counters added to its open tenure, so the current champion's figures are
        as fresh as the schedule (workflows/schedules.py). Idempotent: a retried sample
        adds the growth since the last one, which is zero."""
        with transaction(self._sessions) as session:
            names = serving_loop_names(session=session, limit=input.max_loops)
        result = ServingLedgerResult()
        for name in names:
            if activity.in_activity():  # tests call it as a method
                activity.heartbeat(name)
            if self._sampler.sample(name, None):
                result.sampled += 1
            else:
                result.unreadable += 1
        return result

    def activities(self) -> list[Callable[..., Any]]:
        return [self.sample_serving_ledgers]
