"""Links into the Temporal Web UI."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from services.dashboard.links import TemporalLinks
from workflows.ids import cycle_workflow_id, loop_workflow_id


def _links(ui_url: str | None, namespace: str = "default") -> TemporalLinks:
    return TemporalLinks(ui_url, namespace, loop_workflow_id, cycle_workflow_id)


def test_workflow_ids_are_one_encoded_path_segment() -> None:
    links = _links("http://localhost:8233/")
    assert links.loop("support-bot") == (
        "http://localhost:8233/namespaces/default/workflows/loop%2Fsupport-bot"
    )
    assert links.cycle_stage("support-bot", 3, "train") == (
        "http://localhost:8233/namespaces/default/workflows/loop%2Fsupport-bot%2Fcycle%2F3%2Ftrain"
    )


def test_the_namespace_is_encoded_too() -> None:
    url = _links("https://temporal.example.com", "team a/prod").loop("x")
    assert url == "https://temporal.example.com/namespaces/team%20a%2Fprod/workflows/loop%2Fx"


def test_the_loop_search_uses_the_search_attribute() -> None:
    url = _links("http://ui:8080").loop_search("support-bot")
    assert url is not None
    parts = urlsplit(url)
    assert parts.path == "/namespaces/default/workflows"
    assert parse_qs(parts.query) == {"query": ['RatchetLoop="support-bot"']}


def test_without_a_ui_there_are_no_links() -> None:
    links = _links(None)
    assert links.loop("x") is None
    assert links.cycle_stage("x", 1, "train") is None
    assert links.loop_search("x") is None
