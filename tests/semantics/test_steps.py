"""Durable steps (skiplock.step): each step of a job runs once, whatever happens to the
attempts around it, and its result is what later attempts get. Real workers, a real
database: the handlers count their calls in Python, the steps' records are read from
the table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from processes import spawn_worker_process
from skiplock.retry import RetryPolicy
from skiplock.testing import drain, perform_job

from .conftest import RunCli, Sem, StartWorkers

# Retried at once: the tests wait for the second attempt, not for a back-off.
AT_ONCE = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)
PATIENCE = 30.0


def recorded(sem: Sem, job_id: int) -> list[tuple[str, int, Any]]:
    return [
        (str(name), int(attempt), result)
        for name, attempt, result in sem.execute(
            "SELECT name, attempt, result FROM {schema}.job_steps WHERE job_id = %s "
            "ORDER BY done_at, name",
            (job_id,),
        )
    ]


def test_a_retry_skips_the_steps_an_earlier_attempt_recorded(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def effect(name: str, value: Any) -> Any:
        with lock:
            calls[name] += 1
        return value

    @sem.app.task(name="checkout", max_attempts=3, retry=AT_ONCE)
    def checkout(order_id: int) -> dict[str, Any]:
        charge = skiplock.step("charge", effect, "charge", {"id": f"ch_{order_id}"})
        receipt = skiplock.step("receipt", effect, "receipt", [charge["id"], "sent"])
        if skiplock.current_job().attempts == 1:
            raise RuntimeError("the partner's webhook is down")
        skiplock.step("webhook", effect, "webhook", None)
        return {"charge": charge, "receipt": receipt}

    workers(1)
    ref = sem.enqueue(checkout, order_id=7)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert calls == {"charge": 1, "receipt": 1, "webhook": 1}
    job = sem.job(ref)
    assert job.attempts == 2
    # What a step returns is its result as JSON gives it back, the first time as later.
    assert job.result == {"charge": {"id": "ch_7"}, "receipt": ["ch_7", "sent"]}
    assert recorded(sem, ref) == [
        ("charge", 1, {"id": "ch_7"}),
        ("receipt", 1, ["ch_7", "sent"]),
        ("webhook", 2, None),
    ]
    shown = run_cli("jobs", "show", str(ref))
    assert shown.code == 0
    lines = shown.out.splitlines()
    assert "steps recorded: 3" in lines
    assert any(line.strip().startswith("'charge'  attempt 1") for line in lines), lines
    assert any(line.strip().startswith("'webhook'  attempt 2") for line in lines), lines


def test_async_steps_take_coroutine_functions_and_plain_ones(
    sem: Sem, workers: StartWorkers
) -> None:
    calls: Counter[str] = Counter()

    async def fetch(n: int) -> list[int]:
        calls["fetch"] += 1
        return list(range(n))

    def total(values: list[int]) -> int:
        calls["total"] += 1
        return sum(values)

    @sem.app.task(name="report", max_attempts=2, retry=AT_ONCE)
    async def report(n: int) -> int:
        values = await skiplock.step_async("fetch", fetch, n)
        summed = await skiplock.step_async("total", total, values)
        if skiplock.current_job().attempts == 1:
            raise RuntimeError("failed after both steps")
        return int(summed)

    workers(1)
    ref = sem.enqueue(report, n=4)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert calls == {"fetch": 1, "total": 1}
    assert sem.job(ref).result == 6


def test_a_step_name_used_twice_in_one_attempt_fails_it_saying_so(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="loop", max_attempts=1)
    def loop() -> None:
        for i in range(2):
            skiplock.step("page", lambda i=i: i)

    workers(1)
    ref = sem.enqueue(loop)
    job = sem.wait_for_state(ref, "dead", timeout=PATIENCE)

    assert "step 'page' ran already in this attempt" in job.errors[-1]["message"]
    assert "f'page {i}'" in job.errors[-1]["message"]
    assert recorded(sem, ref) == [("page", 1, 0)]


def test_a_step_that_raised_may_be_tried_again_in_the_same_attempt(
    sem: Sem, workers: StartWorkers
) -> None:
    """Only a step that returned uses its name: one that raised recorded nothing, and a
    handler that catches the error may call it again."""
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("the first try fails")
        return "second try"

    @sem.app.task(name="again", max_attempts=1)
    def again() -> str:
        try:
            return str(skiplock.step("call", flaky))
        except ConnectionError:
            return str(skiplock.step("call", flaky))

    workers(1)
    ref = sem.enqueue(again)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert sem.job(ref).result == "second try"
    assert recorded(sem, ref) == [("call", 1, "second try")]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({1, 2}, "must be JSON"),
        (float("nan"), "must be JSON"),
        ("a\x00b", "not storable"),
        ("\ud800", "not storable"),
    ],
)
def test_a_result_json_cannot_hold_fails_the_attempt_and_is_not_recorded(
    sem: Sem, workers: StartWorkers, value: Any, reason: str
) -> None:
    @sem.app.task(name="odd", max_attempts=1)
    def odd() -> None:
        skiplock.step("kept", lambda: "fine")
        skiplock.step("odd", lambda: value)

    workers(1)
    ref = sem.enqueue(odd)
    job = sem.wait_for_state(ref, "dead", timeout=PATIENCE)

    assert "step 'odd'" in job.errors[-1]["message"]
    assert reason in job.errors[-1]["message"]
    assert recorded(sem, ref) == [("kept", 1, "fine")]


@pytest.mark.server_version
def test_an_attempt_that_lost_its_job_records_no_step_and_is_told(
    sem: Sem, workers: StartWorkers
) -> None:
    """The fence: once the job's attempt moved on (a rescue gave it to another worker),
    the old attempt's step is not recorded, and the handler gets LeaseLostError."""
    seen: list[BaseException] = []

    @sem.app.task(name="stale", max_attempts=1)
    def stale() -> None:
        skiplock.step("first", lambda: 1)
        job = skiplock.current_job()
        # As a rescue and another worker's claim would leave the row: a later attempt.
        sem.execute("UPDATE {jobs} SET attempts = attempts + 1 WHERE id = %s", (job.id,))
        try:
            skiplock.step("second", lambda: 2)
        except skiplock.LeaseLostError as exc:
            seen.append(exc)
            raise

    workers(1)
    ref = sem.enqueue(stale)
    wait_until(lambda: bool(seen), PATIENCE, "the stale attempt's second step")

    assert "no longer holds the job" in str(seen[0])
    assert recorded(sem, ref) == [("first", 1, 1)]


def test_a_step_outside_a_job_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"skiplock.step\(\) called outside a running job"):
        skiplock.step("x", lambda: 1)


def test_a_transactional_jobs_steps_commit_with_it_and_roll_back_with_a_failed_attempt(
    sem: Sem, workers: StartWorkers
) -> None:
    """A transactional attempt's steps are written in its transaction: a failed attempt
    rolls them back with the step's own writes, so the retry runs the step again; the
    successful attempt's records commit with the job."""
    sem.execute("CREATE TABLE {schema}.ledger (job_id bigint, note text)")
    calls: Counter[str] = Counter()

    @sem.app.task(name="post", queue="ledger", transactional=True, max_attempts=2, retry=AT_ONCE)
    def post(conn: psycopg.Connection[Any]) -> str:
        job = skiplock.current_job()

        def write() -> str:
            calls["write"] += 1
            conn.execute(f'INSERT INTO "{sem.schema}".ledger VALUES (%s, %s)', (job.id, "posted"))
            return "posted"

        note = str(skiplock.step("write", write))
        if calls["write"] == 1:
            raise RuntimeError("the first attempt fails after its step")
        return note

    workers(1, queues=["ledger"])
    ref = sem.enqueue(post)
    sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert calls["write"] == 2
    assert sem.execute("SELECT count(*) FROM {schema}.ledger") == [(1,)]
    assert [(name, result) for name, _, result in recorded(sem, ref)] == [("write", "posted")]


def test_steps_in_the_testing_helpers(sem: Sem) -> None:
    """perform_job runs steps without a database (each once per call); drain records
    them in the test's transaction."""
    calls: Counter[str] = Counter()

    def count(name: str) -> str:
        calls[name] += 1
        return name

    @sem.app.task(name="two_steps")
    def two_steps() -> list[str]:
        return [skiplock.step("a", count, "a"), skiplock.step("b", count, "b")]

    assert perform_job(two_steps).result == ["a", "b"]
    with sem.connect(autocommit=False) as conn:
        two_steps.enqueue(conn)
        outcomes = drain(conn, sem.app)
        rows = conn.execute(f'SELECT name FROM "{sem.schema}".job_steps ORDER BY name').fetchall()
        conn.rollback()
    assert [o.result for o in outcomes] == [["a", "b"]]
    assert rows == [("a",), ("b",)]
    assert calls == {"a": 2, "b": 2}


# -- docs/durable.md, as a reader runs it ------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "durable.md"


def test_the_checkout_example_of_the_docs_charges_once(sem: Sem, tmp_path: Path) -> None:
    """The page's first example, its files written as given and run as its commands say:
    the first attempt fails at the webhook, the retry skips the charge and the receipt."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    app_file = next(b for b in blocks if b.startswith("# checkout.py"))
    start_file = next(b for b in blocks if b.startswith("# start_checkout.py"))
    (tmp_path / "checkout.py").write_text(app_file)
    (tmp_path / "start_checkout.py").write_text(start_file)
    env = {
        **os.environ,
        "SKIPLOCK_DATABASE_URL": sem.url,
        "SKIPLOCK_SCHEMA": sem.schema,
        "PYTHONPATH": str(tmp_path),
    }
    started = subprocess.run(
        [sys.executable, "start_checkout.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = int(started.stdout.split()[-1])
    log = tmp_path / "worker.log"
    worker = spawn_worker_process(
        sem.url,
        "checkout:app",
        "--poll-interval",
        "0.1",
        log_path=log,
        schema=sem.schema,
        env={"PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"},
    )
    try:
        sem.wait_for_state(job_id, "completed", timeout=PATIENCE)
    finally:
        worker.kill()
    printed = log.read_text()
    assert printed.count("charging order 7") == 1, printed
    assert printed.count("receipt for 7: ch_7") == 1, printed
    assert printed.count("partner told about 7") == 1, printed
    assert sem.job(job_id).result == "ch_7"


def test_many_sync_handlers_taking_steps_at_once_each_complete_in_one_attempt(
    sem: Sem, workers: StartWorkers
) -> None:
    """Steps of many jobs go to the database in batches; requests from handler threads
    arrive while a batch is taken and written, and each must land in a batch and be
    answered as written (a lost one hung its job, a late one read as a lost lease)."""

    @sem.app.task(name="many", max_attempts=1)
    def many() -> int:
        return sum(int(skiplock.step(f"s{n}", lambda n=n: n)) for n in range(10))

    workers(1, concurrency=20)
    ids = sem.enqueue_many([many.job() for _ in range(300)])
    sem.wait_for_all(ids, "completed", timeout=PATIENCE)

    rows = sem.execute(
        "SELECT count(*), max(attempts), min(result::int) FROM {history} WHERE id = ANY(%s)",
        (ids,),
    )
    assert rows == [(300, 1, 45)]
