"""Links from the dashboard into the Temporal Web UI.

The workflow ids are business keys (``loop/<name>``, ``loop/<name>/cycle/<n>/<stage>``);
the caller passes the functions that make them (``workflows.ids``) so the ids have one
source and this package does not import the workflows. An id holds slashes, so it is
percent-encoded as one path segment; the UI redirects ``/workflows/<id>`` to the latest run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlencode

# Which cycle stage ran each kind of job, so a run links to the workflow that started it.
RUN_KIND_STAGE = {"train": "train", "eval": "evaluate", "probe": "probe"}

# The cycle stages that run as child workflows (DESIGN §4); probe only with the difficulty
# filter on.
CHILD_WORKFLOW_STAGES = ("curate", "probe", "train", "evaluate", "promote")


@dataclass(frozen=True)
class TemporalLinks:
    """Builds Web UI URLs; with no UI configured every link is ``None``."""

    ui_url: str | None
    namespace: str
    loop_workflow_id: Callable[[str], str]
    cycle_workflow_id: Callable[[str, int, str], str]

    def workflow(self, workflow_id: str) -> str | None:
        if not self.ui_url:
            return None
        return (
            f"{self.ui_url.rstrip('/')}/namespaces/{quote(self.namespace, safe='')}"
            f"/workflows/{quote(workflow_id, safe='')}"
        )

    def loop(self, loop: str) -> str | None:
        return self.workflow(self.loop_workflow_id(loop))

    def cycle_stage(self, loop: str, cycle: int, stage: str) -> str | None:
        return self.workflow(self.cycle_workflow_id(loop, cycle, stage))

    def loop_search(self, loop: str) -> str | None:
        """Every workflow of the loop, through the ``RatchetLoop`` search attribute."""
        if not self.ui_url:
            return None
        query = urlencode({"query": f'RatchetLoop="{loop}"'})
        return (
            f"{self.ui_url.rstrip('/')}/namespaces/{quote(self.namespace, safe='')}"
            f"/workflows?{query}"
        )
