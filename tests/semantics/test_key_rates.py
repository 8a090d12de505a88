"""Rate limits per key: at most N of a key's jobs admitted in any window of the period,
across all workers (admission, sql/keys.py, logs each rate-limited key's admissions).
Jobs over the rate wait as 'blocked'; they never fail. Checks are computed from the
handlers' own records (``Timeline``), as for queue limits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import skiplock
from skiplock import history

from .conftest import Sem, StartWorkers
from .test_limits import PATIENCE
from .timeline import Timeline, WindowLog, max_overlap, most_starts_within

pytestmark = [pytest.mark.server_version, pytest.mark.timeout(90)]

# Admission is stamped a little before the handler starts.
SLACK = 0.05


def test_a_rate_key_spreads_its_starts_and_keys_do_not_share_a_rate(
    sem: Sem, workers: StartWorkers
) -> None:
    jobs, period, per_key = 5, 1.0, 15
    timeline = Timeline()

    @sem.app.task(name="call_api")
    async def call_api(account: str, n: int) -> None:
        with timeline.run(account, n):
            await asyncio.sleep(0)

    workers(3)
    specs = [
        call_api.with_options(rate_key=f"api:{account}", rate_limit=f"{jobs}/s").job(
            account=account, n=n
        )
        for n in range(per_key)
        for account in ("a", "b")
    ]
    with WindowLog(lambda: sem.execute("SELECT key, admissions FROM {key_rates}")) as log:
        ids = sem.enqueue_many(specs)
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    for account in ("a", "b"):
        starts = [r.start for r in timeline.runs(account)]
        assert len(starts) == per_key
        admitted = log.times(f"api:{account}")
        assert len(admitted) == per_key, admitted
        # The rate holds for admissions, on the database's clock, exactly.
        assert most_starts_within(admitted, period) <= jobs, admitted
        # 15 admissions at 5 a second: at least two periods from the first to the last.
        assert admitted[-1] - admitted[0] >= 2 * period
    # Each key has its own rate: the two keys' first windows overlap in time.
    first_a = min(r.start for r in timeline.runs("a"))
    first_b = min(r.start for r in timeline.runs("b"))
    assert abs(first_a - first_b) < period - SLACK
    rows = sem.execute("SELECT attempts, errors FROM {history} WHERE id = ANY(%s)", (ids,))
    assert rows == [(1, [])] * len(ids)


def test_an_ordering_key_with_a_rate_keeps_order_and_rate(sem: Sem, workers: StartWorkers) -> None:
    jobs, period, total = 3, 1.0, 9
    timeline = Timeline()

    @sem.app.task(name="apply")
    async def apply(n: int) -> None:
        with timeline.run("order", n):
            await asyncio.sleep(0.01)

    workers(2)
    keyed = apply.with_options(ordering_key="order:1", rate_limit=(jobs, period))
    with WindowLog(lambda: sem.execute("SELECT key, admissions FROM {key_rates}")) as log:
        ids = sem.enqueue_many([keyed.job(n=n) for n in range(total)])
        sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    runs = timeline.runs("order")
    assert [r.n for r in runs] == list(range(total))
    assert max_overlap(runs) == 1
    # The rate holds for admissions, on the database's clock (a handler's start can lag
    # its admission on a loaded machine, bringing two windows' starts closer together).
    admitted = log.times("order:1")
    assert len(admitted) == total, admitted
    assert most_starts_within(admitted, period) <= jobs, admitted


def test_a_rate_key_runs_at_most_its_rate_count_at_once(sem: Sem) -> None:
    @sem.app.task(name="fetch")
    def fetch(n: int) -> None: ...

    spec = fetch.with_options(rate_key="feeds", rate_limit="100/minute").job(n=1)
    assert (spec.ordering_key, spec.key_limit, spec.key_rate) == ("feeds", 100, (100, 60.0))
    limited = fetch.with_options(
        concurrency_key="feeds", concurrency_limit=4, rate_limit="100/minute"
    ).job(n=1)
    assert (limited.key_limit, limited.key_rate) == (4, (100, 60.0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rate_key": "k"}, "rate_key needs a rate_limit"),
        ({"rate_limit": "5/s"}, "rate_limit needs a key"),
        ({"rate_key": "k", "rate_limit": "often"}, "rate 'often'"),
        ({"rate_key": "k", "rate_limit": (0, 1.0)}, "a rate must be"),
        ({"rate_key": "k", "rate_limit": (5, float("nan"))}, "a rate must be"),
        ({"rate_key": "k", "ordering_key": "k"}, "give one of"),
    ],
)
def test_bad_key_rates_fail_naming_the_option(
    sem: Sem, options: dict[str, Any], message: str
) -> None:
    @sem.app.task(name="bad_rate")
    def bad(n: int) -> None: ...

    with pytest.raises(skiplock.ConfigurationError, match=message):
        bad.with_options(**options)


def test_idle_key_rate_logs_are_deleted_by_maintenance(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="ping")
    async def ping(n: int) -> None: ...

    workers(1)
    ids = sem.enqueue_many(
        [ping.with_options(rate_key=f"k{n}", rate_limit="10/s").job(n=n) for n in range(3)]
    )
    sem.wait_for_all(ids, "completed", timeout=PATIENCE)
    assert len(sem.execute("SELECT key FROM {key_rates}")) == 3
    # As if the period had passed: nothing left in any window, nothing waiting.
    sem.execute(
        "UPDATE {key_rates} SET admissions = ARRAY[now() - interval '1 hour']::timestamptz[]"
    )
    with sem.connect() as conn:
        history.maintain(conn, sem.schema, retention=None)
    assert sem.execute("SELECT key FROM {key_rates}") == []
