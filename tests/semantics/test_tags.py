"""Tags: labels a job carries in its meta (migration 0032), set by the task or the call,
kept through every enqueue path and into history, and found by ``tag`` filters that the
partial GIN indexes serve."""

from __future__ import annotations

import json
from typing import Any

import pytest

import skiplock
from skiplock import client

from .conftest import Sem, StartWorkers

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(60)]


def tags_of(sem: Sem, job_id: int) -> Any:
    rows = sem.execute(
        "SELECT meta -> 'tags' FROM {jobs} WHERE id = %(id)s "
        "UNION ALL SELECT meta -> 'tags' FROM {history} WHERE id = %(id)s",
        {"id": job_id},
    )
    assert rows, f"no job {job_id}"
    return rows[0][0]


def test_every_enqueue_path_stores_the_tags(sem: Sem) -> None:
    @sem.app.task(name="charge", tags=["billing"])
    def charge(n: int) -> None: ...

    @sem.app.task(name="mail", unique=True)
    def mail(n: int) -> None: ...

    one = sem.enqueue(charge, n=1)
    own = sem.enqueue(charge.with_options(tags=["eu", "vip", "eu"]), n=2)
    untagged = sem.enqueue(charge.with_options(tags=[]), n=3)
    copied = sem.enqueue_many([charge.job(n=n) for n in range(4, 7)])
    unique = sem.enqueue_many([mail.with_options(tags=["digest"]).job(n=n) for n in range(3)])
    windowed = sem.enqueue(
        mail.with_options(unique_key="w", unique_window=60, tags=["digest"]), n=9
    )
    with sem.connect(autocommit=False) as conn:
        wf = sem.app.workflow()
        first = wf.add(charge.job(n=7))
        wf.add(mail.with_options(tags=["after"]).job(n=8), after=[first])
        steps = wf.enqueue(conn).steps
        conn.commit()

    assert tags_of(sem, one) == ["billing"]
    assert tags_of(sem, own) == ["eu", "vip"]  # the call's replace the task's, each once
    assert tags_of(sem, untagged) is None
    assert [tags_of(sem, i) for i in copied] == [["billing"]] * 3
    assert [tags_of(sem, i) for i in unique] == [["digest"]] * 3
    assert tags_of(sem, windowed) == ["digest"]
    assert tags_of(sem, steps["charge"]) == ["billing"]
    assert tags_of(sem, steps["mail"]) == ["after"]
    with sem.connect() as conn:
        assert sorted(j.id for j in client.list_jobs(conn, sem.schema, tag="billing")) == sorted(
            [one, *copied, steps["charge"]]
        )
        assert client.get_job(conn, sem.schema, own).tags == ("eu", "vip")


def test_tags_join_a_trace_context_in_the_meta(sem: Sem) -> None:
    @sem.app.task(name="traced", tags=["t"])
    def traced() -> None: ...

    with sem.connect(autocommit=False) as conn:
        job_id, _ = client.insert_job(conn, sem.schema, traced.job(), meta='{"trace": "x"}')
        ids = client.insert_jobs(conn, sem.schema, [traced.job()] * 2, meta='{"trace": "y"}')
        conn.commit()
    meta = sem.execute("SELECT id, meta FROM {jobs} ORDER BY id")
    assert [m for _, m in meta] == [
        {"trace": "x", "tags": ["t"]},
        {"trace": "y", "tags": ["t"]},
        {"trace": "y", "tags": ["t"]},
    ]
    assert [i for i, _ in meta] == [job_id, *ids]


def test_tags_move_to_history_and_a_replay_keeps_them(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="export", tags=["reports", "eu"])
    def export(n: int) -> int:
        return n

    done = sem.enqueue(export, n=1)
    workers(1)
    sem.wait_for_state(done, "completed")
    assert tags_of(sem, done) == ["reports", "eu"]
    with sem.connect() as conn:
        assert client.select_job_ids(conn, sem.schema, state="completed", tag="eu") == [done]
        assert client.select_job_ids(conn, sem.schema, state="completed", tag="us") == []
        copy = client.retry_job(conn, sem.schema, done)
    assert copy != done
    sem.wait_for_state(copy, "completed")
    assert tags_of(sem, copy) == ["reports", "eu"]


def test_a_tag_filter_uses_the_index_on_history(sem: Sem) -> None:
    """Among 20,000 finished jobs, half of them tagged 'common', the few tagged 'rare' are
    found through job_history_tags: the planner's choice, with the tags' statistics
    (without them it walked the whole id index), not forced."""
    sem.execute(
        "INSERT INTO {history} (id, queue, task, args, state, priority, attempts, max_attempts, "
        "errors, created_at, attempted_at, finished_at, meta) "
        "SELECT n, 'default', 'noop', '{{}}', 'completed', 0, 1, 3, '[]', now(), now(), now(), "
        "CASE WHEN n %% 1000 = 0 THEN jsonb_build_object('tags', jsonb_build_array('rare')) "
        "     WHEN n %% 2 = 0 THEN jsonb_build_object('tags', jsonb_build_array('common')) END "
        "FROM generate_series(1, 20000) AS n",
        {},
    )
    sem.execute("ANALYZE {history}")
    with sem.connect() as conn:
        plan = conn.execute(
            "EXPLAIN (FORMAT JSON) SELECT id FROM "
            + f'"{sem.schema}".job_history'
            + " WHERE meta ? 'tags' AND meta -> 'tags' @> %s::jsonb",
            ('["rare"]',),
        ).fetchone()
        assert plan is not None
        assert "job_history_" in json.dumps(plan[0]) and "Bitmap Index Scan" in json.dumps(plan[0])
        assert len(client.select_job_ids(conn, sem.schema, state="completed", tag="rare")) == 20


def test_bad_tags_are_refused_when_defined(sem: Sem) -> None:
    with pytest.raises(skiplock.ConfigurationError, match=r"one tag: tags=\['billing'\]"):
        sem.app.task(name="a", tags="billing")(lambda: None)
    with pytest.raises(skiplock.ConfigurationError, match=r"tag name .has space. may only contain"):
        sem.app.task(name="b", tags=["has space"])(lambda: None)
    with pytest.raises(skiplock.ConfigurationError, match="at most 64"):
        sem.app.task(name="c", tags=["x" * 65])(lambda: None)
    with pytest.raises(skiplock.ConfigurationError, match="at most 16 tags"):
        sem.app.task(name="d", tags=[f"t{n}" for n in range(17)])(lambda: None)

    @sem.app.task(name="e")
    def e() -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match="tag name must be a non-empty"):
        e.with_options(tags=[""])


def test_tags_written_by_hand_do_not_break_reads(sem: Sem) -> None:
    @sem.app.task(name="f")
    def f() -> None: ...

    odd = sem.enqueue(f)
    sem.execute(
        "UPDATE {jobs} SET meta = %s::jsonb WHERE id = %s",
        ('{"tags": ["ok", 3, {"no": 1}]}', odd),
    )
    other = sem.enqueue(f)
    sem.execute("UPDATE {jobs} SET meta = %s::jsonb WHERE id = %s", ('{"tags": "x"}', other))
    with sem.connect() as conn:
        assert client.get_job(conn, sem.schema, odd).tags == ("ok",)
        assert client.get_job(conn, sem.schema, other).tags == ()
        assert [j.id for j in client.list_jobs(conn, sem.schema, tag="ok")] == [odd]


def test_each_history_partition_gets_the_tags_statistics(sem: Sem) -> None:
    """The planner ignores a partial index's statistics: the expression has its own, per
    partition, made with the partition (without them a rare tag's page walked the id
    index of every partition)."""
    sem.execute("SELECT {schema}.history_partition_create((now() + interval '40 days')::date)")
    made = sem.execute(
        "SELECT s.stxname, c.relname FROM pg_statistic_ext AS s "
        "JOIN pg_class AS c ON c.oid = s.stxrelid "
        "WHERE s.stxnamespace = %s::regnamespace ORDER BY c.relname",
        (sem.schema,),
    )
    tables = {table for _, table in made}
    partitions = {
        str(r[0])
        for r in sem.execute(
            "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = %s::regclass",
            (f'"{sem.schema}".job_history',),
        )
    }
    assert {p.split(".")[-1].strip('"') for p in partitions} | {"jobs"} == tables
    assert all(name == f"{table}_tags" for name, table in made)
    assert len(partitions) >= 3  # the default partition, today's, the one made above
