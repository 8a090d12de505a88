"""One admission pass (skiplock.admission.admit_pass) keeps a bad row to itself (issue 10,
item 2): when the set-based statement fails on a value of one row, the other keys are
still admitted, the row that cannot be admitted even alone ends dead with the
database's reason, and its line moves on.

The bad rows are made by constraints on the jobs table that refuse one job a state (as a
constraint added later by a DBA refuses old rows): real refusals by PostgreSQL, at the
moment admission writes the row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from skiplock import admission
from skiplock.admission import AdmissionReport, FailureLog
from skiplock.sql import keys, render

from .conftest import Sem, StartWorkers

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]


def admit_pass(
    sem: Sem, asked: Sequence[str] | None = None, failure_log: FailureLog | None = None
) -> AdmissionReport:
    async def run() -> AdmissionReport:
        async with await psycopg.AsyncConnection.connect(sem.url, autocommit=True) as conn:
            return await admission.admit_pass(
                conn,
                sem.schema,
                None if asked is None else list(asked),
                failure_log=failure_log or FailureLog(),
            )

    return asyncio.run(run())


def set_based_admission(sem: Sem) -> None:
    """ADMIT for every waiting key alone, as the leader ran it before the fallback."""
    with sem.connect() as conn:
        waiting = [row[0] for row in conn.execute(render(keys.KEYS_WAITING, sem.schema))]
        conn.execute(render(keys.ADMIT, sem.schema), {"keys": waiting}).fetchall()


def refuse(sem: Sem, name: str, check: str, *, not_valid: bool = False) -> None:
    sem.execute(
        f"ALTER TABLE {{jobs}} ADD CONSTRAINT {name} CHECK ({check})"
        + (" NOT VALID" if not_valid else "")
    )


def poisoned(yes: bool) -> dict[str, Any]:
    """Arguments that carry the 'poison' key (which the test's constraint looks for) or not."""
    return {"poison": True} if yes else {}


def states(sem: Sem, ids: Sequence[int]) -> list[str | None]:
    found = dict(sem.execute("SELECT id, state FROM {jobs} WHERE id = ANY(%s)", (list(ids),)))
    return [found.get(job_id) for job_id in ids]


def last_error(sem: Sem, job_id: int) -> dict[str, Any]:
    rows = sem.execute("SELECT errors -> -1 FROM {jobs} WHERE id = %s", (job_id,))
    assert rows and rows[0][0], f"job {job_id} has no error"
    return dict(rows[0][0])


@pytest.mark.parametrize("asked", [None, ["good", "bad", "wide"]], ids=["all", "asked"])
def test_a_row_that_cannot_be_admitted_ends_dead_and_every_other_key_is_admitted(
    sem: Sem, asked: list[str] | None
) -> None:
    @sem.app.task(name="sync")
    def sync(n: int, poison: bool = False) -> None: ...

    refuse(sem, "no_poison_runs", "state IN ('blocked', 'dead') OR NOT args ? 'poison'")
    good = [int(sem.enqueue(sync.with_options(ordering_key="good"), n=n)) for n in range(2)]
    poison = int(sem.enqueue(sync.with_options(ordering_key="bad"), n=0, poison=True))
    behind = int(sem.enqueue(sync.with_options(ordering_key="bad"), n=1))
    wide = [
        int(sem.enqueue(sync.with_options(concurrency_key="wide", concurrency_limit=3), n=n))
        for n in range(3)
    ]
    with pytest.raises(psycopg.errors.CheckViolation):
        set_based_admission(sem)  # the poison is real: the statement for all keys fails

    report = admit_pass(sem, asked)

    assert report.admitted == 1 + 1 + 3
    assert report.dead == [poison]
    assert list(report.failed) == ["bad"]
    assert "no_poison_runs" in report.failed["bad"]
    assert states(sem, [*good, poison, behind, *wide]) == [
        "available",
        "blocked",
        "dead",
        "available",
        "available",
        "available",
        "available",
    ]
    error = last_error(sem, poison)
    assert error["type"] == "AdmissionFailed"
    assert error["message"].startswith("could not be admitted: ")
    assert "no_poison_runs" in error["message"]

    again = admit_pass(sem, asked)
    assert (again.admitted, again.failed, again.dead) == (0, {}, [])


def test_one_bad_row_among_many_keys_is_found_and_every_other_key_admitted(sem: Sem) -> None:
    @sem.app.task(name="sync")
    def sync(n: int, poison: bool = False) -> None: ...

    refuse(sem, "no_poison_runs", "state IN ('blocked', 'dead') OR NOT args ? 'poison'")
    ids = [
        int(sem.enqueue(sync.with_options(ordering_key=f"k{n:02}"), n=n, **poisoned(n == 23)))
        for n in range(37)
    ]

    report = admit_pass(sem)

    assert (report.admitted, report.dead, list(report.failed)) == (36, [ids[23]], ["k23"])
    assert states(sem, ids) == ["dead" if n == 23 else "available" for n in range(37)]


def test_a_row_that_cannot_be_made_dead_either_leaves_only_its_key_waiting(
    sem: Sem, caplog: pytest.LogCaptureFixture
) -> None:
    @sem.app.task(name="sync")
    def sync(n: int, stuck: bool = False) -> None: ...

    stuck = int(sem.enqueue(sync.with_options(ordering_key="stuck"), n=0, stuck=True))
    # Added later, not validated: the old row stays, and every change to it is refused.
    refuse(sem, "nothing_stuck", "NOT args ? 'stuck'", not_valid=True)
    others = [int(sem.enqueue(sync.with_options(ordering_key=f"k{n}"), n=n)) for n in range(5)]
    failure_log = FailureLog(interval=3600)

    with caplog.at_level(logging.WARNING, logger="skiplock.admission"):
        first = admit_pass(sem, failure_log=failure_log)
        second = admit_pass(sem, failure_log=failure_log)

    assert (first.admitted, first.dead, list(first.failed)) == (5, [], ["stuck"])
    assert (second.admitted, second.dead, list(second.failed)) == (0, [], ["stuck"])
    assert states(sem, [stuck, *others]) == ["blocked"] + ["available"] * 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "stuck" in r.message]
    assert len(warnings) == 1, "a failing key is warned about once per interval"


def test_when_every_key_fails_no_job_is_made_dead(sem: Sem) -> None:
    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    refuse(sem, "nothing_runs", "state IN ('blocked', 'dead') OR ordering_key IS NULL")
    ids = [int(sem.enqueue(sync.with_options(ordering_key=f"k{n}"), n=n)) for n in range(3)]

    report = admit_pass(sem)

    assert (report.admitted, report.dead) == (0, [])
    assert sorted(report.failed) == ["k0", "k1", "k2"]
    assert states(sem, ids) == ["blocked"] * 3


def test_an_absurd_stored_rate_period_neither_fails_admission_nor_a_long_sleep(
    sem: Sem,
) -> None:
    """A period no interval can hold (1e20 s, written by hand) used to fail the statement
    for every key ('interval out of range'); periods are now compared in seconds, and the
    wait reported for the key is bounded."""

    @sem.app.task(name="sync")
    def sync(n: int) -> None: ...

    limited = sync.with_options(rate_key="api", rate_limit="1/s")
    ids = [int(sem.enqueue(limited, n=n)) for n in range(2)]
    sem.execute("UPDATE {jobs} SET key_period = 1e20 WHERE id = ANY(%s)", (ids,))
    other = int(sem.enqueue(sync.with_options(ordering_key="other"), n=9))

    first = admit_pass(sem)
    second = admit_pass(sem, ["api", "other"])

    assert (first.admitted, first.failed, first.dead) == (2, {}, [])
    assert first.rate_due == {"api": admission.RATE_DUE_MAX}
    assert (second.admitted, second.failed) == (0, {})
    assert states(sem, [*ids, other]) == ["available", "blocked", "available"]


def test_a_worker_admits_every_other_key_past_a_row_that_cannot_be_admitted(
    sem: Sem, workers: StartWorkers
) -> None:
    ran: list[int] = []

    @sem.app.task(name="sync")
    def sync(n: int, poison: bool = False) -> None:
        ran.append(n)

    refuse(sem, "no_poison_runs", "state IN ('blocked', 'dead') OR NOT args ? 'poison'")
    poison = int(sem.enqueue(sync.with_options(ordering_key="bad"), n=0, poison=True))
    behind = int(sem.enqueue(sync.with_options(ordering_key="bad"), n=1))
    good = int(sem.enqueue(sync.with_options(ordering_key="good"), n=2))
    workers(1)

    sem.wait_for_all([behind, good], "completed", timeout=10)
    assert sem.state_of(poison) == "dead"
    assert sorted(ran) == [1, 2]


# -- decisions, without a database ---------------------------------------------------


def test_the_failure_log_warns_once_per_key_and_interval() -> None:
    log = FailureLog(interval=60, size=2)
    assert log.due("a", 0.0)
    assert not log.due("a", 59.0)
    assert log.due("b", 59.0)
    assert log.due("a", 60.0)
    assert log.due("c", 61.0)  # forgets the oldest, b
    assert log.due("b", 62.0)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (2.5, 2.5),
        (-3.0, admission.RATE_DUE_MIN),
        (0.0, admission.RATE_DUE_MIN),
        (float("nan"), admission.RATE_DUE_MAX),
        (float("inf"), admission.RATE_DUE_MAX),
        (1e20, admission.RATE_DUE_MAX),
        (None, admission.RATE_DUE_MAX),
    ],
)
def test_rate_waits_are_made_safe_to_sleep_on(value: object, seconds: float) -> None:
    assert admission.seconds_until_due(value) == seconds


@pytest.mark.parametrize(
    ("tried", "failed", "at_fault"),
    [(1, 1, True), (5, 1, True), (5, 4, True), (5, 5, False), (2, 2, False), (3, 0, False)],
)
def test_rows_are_blamed_only_when_some_keys_succeed(
    tried: int, failed: int, at_fault: bool
) -> None:
    assert admission.rows_at_fault(tried, failed) is at_fault
