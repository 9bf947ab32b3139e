"""The task page in headless Chromium: a task's stored successes and failures (the run and
checkpoint that produced each, when, reward), and, in a tab holding the admin token, the
prompt and the episode texts, escaped; without the token the page carries neither (they are
the loop's data, which /v1/tasks guards: issue 43); an unknown or malformed task id is the
not-found page, never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pytest
from sqlalchemy import select

from services.db.models import Demonstration, Loop, Task
from tests.services.dashboard.conftest import (
    ADMIN_TOKEN,
    BrowserPage,
    SeededDatabase,
    dashboard_settings,
    live_server,
)
from tests.services.dashboard.conftest import LiveServer as Server

XSS_EPISODE = "<img src='x' onerror='window.__xss=7'>fmt(date='2026-11-10')"


@pytest.fixture(scope="module")
def page_of_task(seeded_database: SeededDatabase) -> Iterator[tuple[Server, str, int]]:
    """The seeded story plus two successes and a failure of one train task, stored by the
    cycle-2 train run."""
    story = seeded_database.story
    with seeded_database.session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == story.loop)).one()
        task = session.scalars(
            select(Task).where(Task.loop_id == loop.id, Task.split == "train").limit(1)
        ).one()
        for sample, (passed, reward, text) in enumerate(
            [(True, 1.0, XSS_EPISODE), (True, 0.9, "fmt(date='10/11/2026')"), (False, 0.25, "x")]
        ):
            session.add(
                Demonstration(
                    loop_id=loop.id,
                    task_id=task.id,
                    task_hash=str(task.spec.get("task_id", "h")),
                    run_id=story.cycle2_train_run,
                    sample=sample,
                    source="train",
                    checkpoint_id=story.base_checkpoint,
                    family="tiny",
                    passed=passed,
                    reward=reward,
                    text=text,
                    tokens=3,
                    sequences=[[[1, 2, 3], [False, True, True]]],
                )
            )
        task_id = task.id
    settings = dashboard_settings(seeded_database.url, seeded_database.state_dir)
    with live_server(settings, seeded_database.engine) as server:
        yield server, story.loop, task_id


def task_prompt(page_of_task: tuple[Server, str, int]) -> str:
    server, _, task_id = page_of_task
    with server.session_factory() as session:
        return str(session.get_one(Task, task_id).spec["prompt"])


def test_the_task_page_shows_successes_and_failures_and_no_content_without_the_token(
    page_of_task: tuple[Server, str, int], browser_page: BrowserPage
) -> None:
    server, loop, task_id = page_of_task
    page = browser_page.page
    response = page.goto(f"{server.url}/loops/{quote(loop)}/tasks/{task_id}")
    assert response is not None and response.status == 200
    successes = page.locator("#task-successes tbody tr")
    failures = page.locator("#task-failures tbody tr")
    assert successes.count() == 2 and failures.count() == 1
    assert "Successes (2)" in page.locator("#task-successes h2").inner_text()
    first = successes.nth(0).inner_text()
    assert "1.000" in first and "train run" in first
    assert "0.250" in failures.nth(0).inner_text()
    link = successes.nth(0).locator("a[href*='/runs/']")
    assert link.count() == 1
    html = page.content()
    assert XSS_EPISODE not in html and "fmt(date='10/11/2026')" not in html
    assert task_prompt(page_of_task) not in html
    assert "admin token" in page.locator("#task-content-note").inner_text()
    assert browser_page.errors == []


def test_a_tab_holding_the_admin_token_sees_the_prompt_and_episodes_as_text(
    page_of_task: tuple[Server, str, int], browser_page: BrowserPage
) -> None:
    server, loop, task_id = page_of_task
    page = browser_page.page
    url = f"{server.url}/loops/{quote(loop)}/tasks/{task_id}"
    page.goto(url)
    page.evaluate(f"sessionStorage.setItem('ratchet.adminToken', {ADMIN_TOKEN!r})")
    page.goto(url)
    page.wait_for_function("() => !document.getElementById('task-prompt').hidden")
    assert page.locator("#task-prompt").inner_text() == task_prompt(page_of_task)
    first = page.locator("#task-successes tbody tr").nth(0).inner_text()
    assert XSS_EPISODE in first  # shown as text, not markup
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.locator("img[src='x']").count() == 0
    page.evaluate("sessionStorage.clear()")
    assert browser_page.errors == []


@pytest.mark.parametrize("ref", ["999999999", "abc", "-1", "1" * 40])
def test_an_unknown_task_is_not_found(
    page_of_task: tuple[Server, str, int], browser_page: BrowserPage, ref: str
) -> None:
    server, loop, _ = page_of_task
    response = browser_page.page.goto(f"{server.url}/loops/{quote(loop)}/tasks/{ref}")
    assert response is not None and response.status == 404
    assert "has no task" in browser_page.page.content()


def test_the_loop_page_links_its_task_examples_to_their_pages(
    page_of_task: tuple[Server, str, int], browser_page: BrowserPage
) -> None:
    server, loop, _ = page_of_task
    page = browser_page.page
    response = page.goto(f"{server.url}/loops/{quote(loop)}")
    assert response is not None and response.status == 200
    links = page.locator("a[href*='/tasks/']")
    assert links.count() > 0
    href = links.first.get_attribute("href")
    assert href is not None
    links.first.click()
    page.wait_for_url(f"**{href}")
    assert page.locator("#task-summary").count() == 1
    assert page.locator("#task-successes").count() == 1
