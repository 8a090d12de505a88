"""Bad workflows fail while they are built, with a message that names the fix, and
nothing is written (no database here: the checks are pure)."""

from __future__ import annotations

import json

import pytest

import skiplock
from skiplock import workflow
from skiplock.errors import ConfigurationError

app = skiplock.App("postgresql://nowhere.invalid/none", schema="wf_building")


@app.task(name="build.step")
def step(n: int = 0) -> int:
    return n


@app.task(name="build.unique", unique=True)
def unique_step() -> None: ...


def test_default_names_are_the_task_numbered_and_given_names_are_kept() -> None:
    wf = app.workflow("names")
    wf.add(step.job())
    wf.add(step.job())
    wf.add(step.job(), name="mine")
    wf.add(step.job())
    assert wf.step_names == ["build.step", "build.step#2", "mine", "build.step#3"]


def test_duplicate_step_names_are_refused() -> None:
    wf = app.workflow()
    wf.add(step.job(), name="a")
    with pytest.raises(ConfigurationError, match="already has a step named 'a'"):
        wf.add(step.job(), name="a")


def test_a_parent_of_another_workflow_is_refused() -> None:
    one, two = app.workflow(), app.workflow()
    foreign = one.add(step.job())
    with pytest.raises(ConfigurationError, match="belongs to another workflow"):
        two.add(step.job(), after=[foreign])


def test_an_unknown_parent_name_is_refused_listing_the_steps() -> None:
    wf = app.workflow()
    wf.add(step.job(), name="fetch")
    with pytest.raises(ConfigurationError, match=r"no step of that name.*'fetch'"):
        wf.add(step.job(), after=["fecth"])


def test_parents_by_name_work() -> None:
    wf = app.workflow()
    wf.add(step.job(), name="fetch")
    wf.add(step.job(), name="parse", after="fetch")
    given = json.loads(wf._params()["given"])
    assert given["up"] == ["{}", "{1}"] and given["down"] == ["{2}", "{}"]


def test_an_empty_workflow_is_refused_at_enqueue_before_any_connection() -> None:
    with pytest.raises(ConfigurationError, match="at least one step"):
        app.workflow().enqueue(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="empty workflow"):
        app.workflow().add(app.workflow())


def test_a_step_added_after_enqueue_is_refused() -> None:
    wf = app.workflow()
    wf.add(step.job())
    wf._enqueued = True  # what enqueue sets once written
    with pytest.raises(ConfigurationError, match="enqueued already"):
        wf.add(step.job())


def test_a_workflow_cannot_contain_itself_nor_a_non_job() -> None:
    wf = app.workflow()
    with pytest.raises(ConfigurationError, match="cannot contain itself"):
        wf.add(wf)
    with pytest.raises(ConfigurationError, match=r"task.job\(...\)"):
        wf.add(step)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="after= takes steps"):
        wf.add(step.job(), after=[42])  # type: ignore[list-item]


def test_unique_steps_may_only_be_unique_while_active() -> None:
    app.workflow().add(unique_step.job())  # the 'active' scope: its key held from enqueue on
    for options in ({"unique_scope": "queued"}, {"unique_window": 60}):
        with pytest.raises(ConfigurationError, match="in the 'active' scope only"):
            app.workflow().add(unique_step.with_options(**options).job())
    replacing: list[dict[str, object]] = [{"replace": True}, {"debounce": 30}]
    for replacing_options in replacing:
        with pytest.raises(ConfigurationError, match="cannot replace or debounce"):
            app.workflow().add(unique_step.with_options(**replacing_options).job())


def test_the_step_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workflow, "MAX_STEPS", 3)
    wf = app.workflow()
    for _ in range(3):
        wf.add(step.job())
    with pytest.raises(ConfigurationError, match="at most 3 steps"):
        wf.add(step.job())


def test_cycles_and_bad_parents_in_a_graph_are_found() -> None:
    workflow.check_acyclic([(), (0,), (1,)])
    workflow.check_acyclic([(2,), (), (1,)])  # out of order, but no cycle
    with pytest.raises(ConfigurationError, match="cycle"):
        workflow.check_acyclic([(), (2,), (1,)])
    with pytest.raises(ConfigurationError, match="depends on itself"):
        workflow.check_acyclic([(0,)])
    with pytest.raises(ConfigurationError, match="unknown parent 5"):
        workflow.check_acyclic([(5,)])


def test_bad_names_and_options_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="workflow name"):
        app.workflow("")
    with pytest.raises(ConfigurationError, match="step name"):
        app.workflow().add(step.job(), name="x" * 300)
    with pytest.raises(ConfigurationError, match="run_anyway"):
        app.workflow().add(step.job(), run_anyway="yes")  # type: ignore[arg-type]


def test_shorthands_compose_into_one_graph() -> None:
    wf = skiplock.chain(
        step.job(n=1),
        skiplock.group(step.job(n=2), step.job(n=3)),
        skiplock.chord(skiplock.group(step.job(n=4), step.job(n=5)), step.job(n=6)),
        step.job(n=7),
    )
    parents = {node.name: [wf._nodes[p].name for p in node.parents] for node in wf._nodes}
    assert parents == {
        "build.step": [],
        "build.step#2": ["build.step"],
        "build.step#3": ["build.step"],
        "build.step#4": ["build.step#2", "build.step#3"],
        "build.step#5": ["build.step#2", "build.step#3"],
        "build.step#6": ["build.step#4", "build.step#5"],
        "build.step#7": ["build.step#6"],
    }
    # The shorthands know no App: the one whose tasks these are is found.
    assert wf._owner() is app
