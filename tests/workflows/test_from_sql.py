"""``skiplock.enqueue_workflow(jsonb)`` (migration 0023): a workflow started from SQL, by a
trigger or psql, written as the Python enqueue writes it and released by the same
statements."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

import skiplock
from roles import login_roles
from skiplock import grants
from skiplock.grants import Use
from workflows.conftest import Sem, StartWorkers
from workflows.helpers import enqueue, wait_for_workflow

pytestmark = pytest.mark.server_version

DIAMOND = {
    "name": "report",
    "steps": [
        {"task": "fetch", "args": {"day": "2026-12-03"}},
        {"task": "parse", "name": "left", "after": ["fetch"], "priority": -5},
        {"task": "parse", "name": "right", "after": ["fetch"], "queue": "slow"},
        {"task": "render", "after": ["left", "right", "left"], "max_attempts": 7},
    ],
}


def start(conn: psycopg.Connection[Any], schema: str, workflow: object) -> int:
    row = conn.execute(
        sql.SQL("SELECT {}.enqueue_workflow(%s::jsonb)").format(sql.Identifier(schema)),
        (json.dumps(workflow),),
    ).fetchone()
    assert row is not None
    return int(row[0])


def rows_of(sem: Sem, workflow_id: int) -> list[tuple[Any, ...]]:
    """Each step's rows but the ids: what release and the worker read."""
    return [
        tuple(row)
        for row in sem.execute(
            "SELECT s.step, s.name, s.parents, s.children, s.pending, s.run_anyway, "
            "j.queue, j.task, j.args, j.priority, j.state, j.max_attempts, "
            "w.name, w.options, w.steps, w.steps_left "
            "FROM {schema}.workflow_steps AS s JOIN {jobs} AS j ON j.id = s.job_id "
            "JOIN {schema}.workflows AS w ON w.id = s.workflow_id "
            "WHERE s.workflow_id = %s ORDER BY s.step",
            (workflow_id,),
        )
    ]


def test_the_function_writes_what_the_python_enqueue_writes(sem: Sem) -> None:
    @sem.app.task(name="fetch")
    def fetch(day: str) -> None: ...

    @sem.app.task(name="parse")
    def parse() -> None: ...

    @sem.app.task(name="render", max_attempts=7)
    def render() -> None: ...

    wf = sem.app.workflow("report")
    a = wf.add(fetch.job(day="2026-12-03"))
    left = wf.add(parse.with_options(priority=-5).job(), name="left", after=[a])
    right = wf.add(parse.with_options(queue="slow").job(), name="right", after=[a])
    wf.add(render.job(), after=[left, right])
    by_python = enqueue(sem, wf)

    with sem.connect() as conn:
        by_sql = start(conn, sem.schema, DIAMOND)

    assert rows_of(sem, by_sql) == rows_of(sem, by_python.id)
    assert [row[10] for row in rows_of(sem, by_sql)] == [
        "available",
        "waiting",
        "waiting",
        "waiting",
    ]


def test_a_trigger_on_the_applications_table_starts_a_workflow_that_runs(
    sem: Sem, workers: StartWorkers
) -> None:
    """An order inserted starts its workflow in the inserting transaction; a rolled-back
    order leaves none. The steps then run in order and see their parents' results."""
    seen: dict[str, Any] = {}

    @sem.app.task(name="charge")
    def charge(order_id: int) -> dict[str, int]:
        return {"charged": order_id}

    @sem.app.task(name="receipt")
    def receipt(order_id: int) -> None:
        seen["receipt"] = (order_id, skiplock.parent_results())

    with sem.connect() as conn:
        conn.execute(
            sql.SQL(
                """
                CREATE TABLE {orders} (id bigint PRIMARY KEY, total numeric NOT NULL);
                CREATE FUNCTION {start}() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM {schema}.enqueue_workflow(jsonb_build_object(
                        'name', 'order ' || NEW.id,
                        'steps', jsonb_build_array(
                            jsonb_build_object('task', 'charge',
                                               'args', jsonb_build_object('order_id', NEW.id)),
                            jsonb_build_object('task', 'receipt', 'after', '["charge"]'::jsonb,
                                               'args', jsonb_build_object('order_id', NEW.id)))));
                    RETURN NEW;
                END $$;
                CREATE TRIGGER order_placed AFTER INSERT ON {orders}
                    FOR EACH ROW EXECUTE FUNCTION {start}();
                """
            ).format(
                orders=sql.Identifier(sem.schema, "orders"),
                start=sql.Identifier(sem.schema, "order_placed"),
                schema=sql.Identifier(sem.schema),
            )
        )
    orders = sql.Identifier(sem.schema, "orders")
    with sem.connect(autocommit=False) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (1, 10)").format(orders))
        conn.rollback()
        conn.execute(sql.SQL("INSERT INTO {} VALUES (2, 20)").format(orders))
        conn.commit()

    rows = sem.execute("SELECT id, name FROM {schema}.workflows")
    assert [tuple(row) for row in rows] == [(rows[0][0], "order 2")]
    workers(1)
    wait_for_workflow(sem, int(rows[0][0]), "completed")
    assert seen == {"receipt": (2, {"charge": {"charged": 2}})}


BAD: list[tuple[object, str]] = [
    ([], "takes a JSON object"),
    ({"steps": []}, '"steps" must be a non-empty array'),
    ({"steps": [{"task": "a"}], "colour": "red"}, "unknown field colour"),
    ({"name": "", "steps": [{"task": "a"}]}, "name must be a string of 1 to 255"),
    ({"run_anyway": "yes", "steps": [{"task": "a"}]}, "run_anyway must be true or false"),
    ({"steps": ["a"]}, "step 1 must be an object"),
    ({"steps": [{"name": "x"}]}, 'step 1 (x): "task" must be a task name'),
    ({"steps": [{"task": "a", "arg": {}}]}, "step 1 has unknown field arg"),
    ({"steps": [{"task": "a", "args": [1]}]}, '"args" must be an object'),
    ({"steps": [{"task": "a", "after": "b"}]}, '"after" must be an array of step names'),
    ({"steps": [{"task": "a", "queue": ""}]}, '"queue" must be a queue name'),
    ({"steps": [{"task": "a", "priority": 1.5}]}, '"priority" must be an integer'),
    ({"steps": [{"task": "a", "priority": "1"}]}, '"priority" must be an integer'),
    ({"steps": [{"task": "a", "max_attempts": 0}]}, '"max_attempts" must be an integer'),
    ({"steps": [{"task": "a", "run_at": "soon"}]}, '"run_at" must be a timestamp'),
    ({"steps": [{"task": "a", "run_anyway": 1}]}, '"run_anyway" must be true or false'),
    ({"steps": [{"task": "a"}, {"task": "a"}]}, "two steps are named 'a'"),
    ({"steps": [{"task": "a", "after": ["b"]}]}, "runs after 'b', which is not a step"),
    ({"steps": [{"task": "a", "after": ["a"]}]}, "runs after 'a', itself"),
    (
        {"steps": [{"task": "a", "after": ["b"]}, {"task": "b", "after": ["a"]}]},
        "which is listed after it",
    ),
]


@pytest.mark.parametrize(("workflow", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_problem_and_writes_nothing(
    sem: Sem, workflow: object, message: str
) -> None:
    with sem.connect() as conn, pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        start(conn, sem.schema, workflow)
    assert message in str(raised.value)
    counts = sem.execute(
        "SELECT (SELECT count(*) FROM {schema}.workflows), "
        "(SELECT count(*) FROM {schema}.workflow_steps), (SELECT count(*) FROM {jobs})"
    )
    assert tuple(counts[0]) == (0, 0, 0)


def test_a_role_granted_to_enqueue_may_start_one(sem: Sem, database_url: str) -> None:
    """What `skiplock grant --enqueue` gives is enough: the function runs with the
    caller's rights, so it needs no grant of its own."""
    with login_roles(database_url) as roles:
        role, url = roles.create("enqueue")
        with psycopg.connect(database_url) as owner:
            grants.apply(owner, sem.schema, role, Use.ENQUEUE)
        with psycopg.connect(url) as conn:
            workflow_id = start(conn, sem.schema, DIAMOND)
    assert len(rows_of(sem, workflow_id)) == 4
