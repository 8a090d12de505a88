"""The dashboard's workflow pages (issue 23): the list, and one workflow's steps drawn as a
graph with their states, read as a browser gets them (Starlette's TestClient) from the
real database; the layout itself is pure and tested without one."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

import skiplock
from conftest import StartWorker, wait_until
from skiplock.dashboard import create_app, reads


@pytest.fixture
def web(app: skiplock.App) -> Iterator[TestClient]:
    with TestClient(create_app(app.database_url, app.schema), base_url="http://localhost") as c:
        yield c


def diamond(app: skiplock.App) -> skiplock.Workflow:
    @app.task(name="shop.step")
    def step() -> None:
        return None

    workflow = app.workflow("nightly")
    top = workflow.add(step.job(), name="fetch")
    left = workflow.add(step.job(), name="parse", after=[top])
    right = workflow.add(step.job(), name="price", after=[top])
    workflow.add(step.job(), name="render", after=[left, right])
    return workflow


def enqueue(app: skiplock.App, workflow: skiplock.Workflow) -> skiplock.WorkflowRef:
    with app.connect() as conn:
        ref = workflow.enqueue(conn)
        conn.commit()
    return ref


def test_a_diamond_is_laid_out_in_columns_by_depth_with_an_edge_per_parent() -> None:
    steps = [
        {"step": 1, "name": "a", "parents": [], "state": "completed", "job_id": 11},
        {"step": 2, "name": "b", "parents": [1], "state": "running", "job_id": 12},
        {"step": 3, "name": "c", "parents": [1], "state": "available", "job_id": 13},
        {"step": 4, "name": "d", "parents": [2, 3], "state": "waiting", "job_id": 14},
        # A parent that is not among the steps (a row written by hand) is left out.
        {"step": 5, "name": "e", "parents": [99], "state": "waiting", "job_id": 15},
    ]
    graph = reads.workflow_graph(steps)
    assert graph is not None
    columns = {n.name: n.x for n in graph.nodes}
    assert columns["a"] == columns["e"] < columns["b"] == columns["c"] < columns["d"]
    assert len(graph.edges) == 4
    assert all(x1 < x2 for x1, _, x2, _ in graph.edges)
    assert max(n.x for n in graph.nodes) + graph.node_width <= graph.width
    assert max(n.y for n in graph.nodes) + graph.node_height <= graph.height
    many = [{**steps[0], "step": n, "job_id": n} for n in range(reads.GRAPH_MOST_STEPS + 1)]
    assert reads.workflow_graph(many) is None


def test_a_workflows_page_draws_its_steps_and_the_list_links_to_it(
    app: skiplock.App, web: TestClient
) -> None:
    ref = enqueue(app, diamond(app))

    listed = web.get("/workflows")
    assert listed.status_code == 200
    assert f'href="/workflows/{ref.id}"' in listed.text
    assert "0 of 4" in listed.text and "nightly" in listed.text

    page = web.get(f"/workflows/{ref.id}")
    assert page.status_code == 200, page.text
    drawn = dict(re.findall(r'data-step="([^"]+)" data-state="([^"]+)"', page.text))
    assert drawn == {
        "fetch": "available",
        "parse": "waiting",
        "price": "waiting",
        "render": "waiting",
    }
    assert page.text.count('<line class="edge"') == 4
    assert f'href="/jobs/{int(ref.steps["render"])}"' in page.text
    assert "parse, price" in page.text  # render's parents, by name


def test_a_finished_workflow_shows_every_step_completed(
    app: skiplock.App, web: TestClient, start_worker: StartWorker
) -> None:
    ref = enqueue(app, diamond(app))
    start_worker(app, poll_interval=0.1)
    wait_until(
        lambda: "completed" in web.get(f"/workflows/{ref.id}").text.split("workflow-state")[1][:40],
        30,
        "the workflow to complete",
    )
    page = web.get(f"/workflows/{ref.id}")
    states = set(re.findall(r'data-state="([^"]+)"', page.text))
    assert states == {"completed"}
    assert "4 of 4 ended" in page.text
    assert web.get("/workflows?state=completed").text.count(f'data-workflow="{ref.id}"') == 1
    assert f'data-workflow="{ref.id}"' not in web.get("/workflows?state=running").text


def test_an_unknown_workflow_or_state_is_refused_by_name(web: TestClient) -> None:
    missing = web.get("/workflows/999999")
    assert missing.status_code == 404 and "no workflow with id 999999" in missing.text
    bad = web.get("/workflows?state=done")
    assert bad.status_code == 400 and "unknown workflow state &#39;done&#39;" in bad.text
