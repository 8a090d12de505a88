"""Durable waits, sleeps and signals (skiplock.wait_for, skiplock.sleep, App.signal and
SQL's signal()): a waiting or sleeping job leaves its worker, and resumes with its steps
answered from their records. Real workers, a real database."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from skiplock.history import maintain
from skiplock.retry import RetryPolicy
from skiplock.testing import drain

from .conftest import RunCli, Sem, StartWorkers

AT_ONCE = RetryPolicy(base=0.0, cap=0.0, jitter=0.0)
PATIENCE = 30.0


def kept_signals(sem: Sem) -> list[tuple[str, Any]]:
    return [
        (str(key), payload)
        for key, payload in sem.execute("SELECT key, payload FROM {schema}.signals ORDER BY id")
    ]


def wait_row(sem: Sem, job_id: int) -> tuple[Any, ...]:
    rows = sem.execute(
        "SELECT state, wait_key, wait_step, wait_until IS NOT NULL, worker_id "
        "FROM {schema}.jobs WHERE id = %s",
        (job_id,),
    )
    return tuple(rows[0]) if rows else ()


class Effects:
    """What the handlers did, counted per (job, effect)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[Any, str]] = Counter()

    def __call__(self, job: Any, what: str, value: Any = None) -> Any:
        with self._lock:
            self.counts[job, what] += 1
        return value


@pytest.mark.server_version
def test_a_job_waits_for_its_signal_and_resumes_with_the_payload(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    effects = Effects()

    @sem.app.task(name="checkout")
    def checkout(order_id: int) -> dict[str, Any]:
        charge = skiplock.step("charge", effects, order_id, "charge", {"id": f"ch_{order_id}"})
        payment = skiplock.wait_for(f"payment:{order_id}", timeout=timedelta(hours=1))
        effects(order_id, "after the wait")
        return {"charge": charge, "payment": payment}

    workers(1)
    ref = sem.enqueue(checkout, order_id=42)
    sem.wait_for_state(ref, "waiting", timeout=PATIENCE)

    # It holds nothing: no worker, no lease; it waits for its key, with a deadline.
    assert wait_row(sem, ref) == ("waiting", "payment:42", "wait:payment:42", True, None)
    assert sem.job(ref).attempts == 0  # the attempt that waited was given back
    listed = run_cli("jobs", "list", "--state", "waiting")
    assert listed.code == 0 and "payment:42" in listed.out, listed.out
    shown = run_cli("jobs", "show", str(ref))
    assert "waits for signal 'payment:42'" in shown.out, shown.out

    with sem.connect(autocommit=False) as conn:
        assert sem.app.signal(conn, "payment:42", {"amount": 42}) == ref
        conn.commit()
    job = sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert job.result == {"charge": {"id": "ch_42"}, "payment": {"amount": 42}}
    assert effects.counts == {(42, "charge"): 1, (42, "after the wait"): 1}
    assert job.attempts == 1
    assert kept_signals(sem) == []


def test_a_rolled_back_signal_sends_nothing(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="approval")
    async def approval(request: int) -> Any:
        return await skiplock.wait_for_async(f"approved:{request}")

    workers(1)
    ref = sem.enqueue(approval, request=1)
    sem.wait_for_state(ref, "waiting", timeout=PATIENCE)

    with sem.connect(autocommit=False) as conn:
        assert sem.app.signal(conn, "approved:1", "yes") == ref
        conn.rollback()
    assert wait_row(sem, ref)[:2] == ("waiting", "approved:1")
    assert kept_signals(sem) == []

    with sem.connect() as conn:
        sem.app.signal(conn, "approved:1", "yes, really")
    assert sem.wait_for_state(ref, "completed", timeout=PATIENCE).result == "yes, really"


def test_a_signal_sent_before_the_wait_is_kept_and_answers_it_at_once(
    sem: Sem, workers: StartWorkers
) -> None:
    seen: list[str] = []

    @sem.app.task(name="late_waiter")
    def late_waiter() -> Any:
        payment = skiplock.wait_for("payment:7")
        seen.append(str(sem.state_of(skiplock.current_job().id)))
        return payment

    with sem.connect() as conn:
        # Nobody waits yet: kept, each signal for one wait, oldest first.
        assert sem.app.signal(conn, "payment:7", {"n": 1}) is None
        assert sem.app.signal(conn, "payment:7", {"n": 2}) is None
    assert kept_signals(sem) == [("payment:7", {"n": 1}), ("payment:7", {"n": 2})]

    workers(1)
    first = sem.enqueue(late_waiter)
    assert sem.wait_for_state(first, "completed", timeout=PATIENCE).result == {"n": 1}
    # Answered within the attempt: it never left its worker.
    assert seen == ["running"]
    assert sem.job(first).attempts == 1
    assert kept_signals(sem) == [("payment:7", {"n": 2})]
    second = sem.enqueue(late_waiter)
    assert sem.wait_for_state(second, "completed", timeout=PATIENCE).result == {"n": 2}
    assert kept_signals(sem) == []


@pytest.mark.server_version
def test_a_wait_that_times_out_raises_wait_timeout_on_every_later_attempt(
    sem: Sem, workers: StartWorkers
) -> None:
    attempts: list[str] = []

    @sem.app.task(name="impatient", max_attempts=2, retry=AT_ONCE)
    async def impatient() -> str:
        try:
            await skiplock.wait_for_async("never", timeout=0.2)
        except skiplock.WaitTimeout as exc:
            attempts.append(str(exc))
            if len(attempts) == 1:
                raise RuntimeError("failed after the timeout") from None
            return "gave up waiting"
        return "signalled"

    workers(1)
    ref = sem.enqueue(impatient)
    job = sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert job.result == "gave up waiting"
    # The timeout is the wait's recorded answer: the retry got it again, at once.
    assert len(attempts) == 2
    assert "no signal 'never' came before its wait's timeout" in attempts[0]
    with sem.connect() as conn:
        assert sem.app.signal(conn, "never", 1) is None  # nobody waits: kept
    assert kept_signals(sem) == [("never", 1)]


@pytest.mark.server_version
def test_a_trigger_on_an_application_table_wakes_the_job_through_sql(
    sem: Sem, workers: StartWorkers
) -> None:
    """The docs' example: an order becoming paid, in the application's own transaction,
    sends the signal its job waits for."""
    with sem.connect() as conn:
        conn.execute(
            "CREATE TABLE {schema}.orders (id int PRIMARY KEY, status text, total int)".replace(
                "{schema}", f'"{sem.schema}"'
            )
        )
        conn.execute(
            f"""
            CREATE FUNCTION "{sem.schema}".order_paid() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM "{sem.schema}".signal('payment:' || NEW.id,
                                              jsonb_build_object('total', NEW.total));
                RETURN NEW;
            END $$;
            CREATE TRIGGER order_paid AFTER UPDATE OF status ON "{sem.schema}".orders
            FOR EACH ROW WHEN (NEW.status = 'paid' AND OLD.status IS DISTINCT FROM 'paid')
            EXECUTE FUNCTION "{sem.schema}".order_paid();
            INSERT INTO "{sem.schema}".orders VALUES (5, 'new', 120);
            """
        )

    @sem.app.task(name="ship")
    def ship(order_id: int) -> Any:
        return skiplock.wait_for(f"payment:{order_id}")

    workers(1)
    ref = sem.enqueue(ship, order_id=5)
    sem.wait_for_state(ref, "waiting", timeout=PATIENCE)
    with sem.connect() as conn:
        conn.execute(f"UPDATE \"{sem.schema}\".orders SET status = 'paid' WHERE id = 5")

    assert sem.wait_for_state(ref, "completed", timeout=PATIENCE).result == {"total": 120}


def test_a_sleeping_job_holds_nothing_and_resumes_without_rerunning_its_steps(
    sem: Sem, workers: StartWorkers
) -> None:
    effects = Effects()

    @sem.app.task(name="reminder")
    def reminder(user: int) -> str:
        skiplock.step("welcome", effects, user, "welcome")
        skiplock.sleep(0.5)
        skiplock.step("nudge", effects, user, "nudge")
        skiplock.sleep(timedelta(seconds=0.2))
        return "done"

    workers(1)
    ref = sem.enqueue(reminder, user=3)
    sem.wait_for_state(ref, "scheduled", timeout=PATIENCE)
    assert wait_row(sem, ref)[4] is None  # no worker holds it
    job = sem.wait_for_state(ref, "completed", timeout=PATIENCE)

    assert effects.counts == {(3, "welcome"): 1, (3, "nudge"): 1}
    assert job.attempts == 1
    names = [
        row[0]
        for row in sem.execute(
            "SELECT name FROM {schema}.job_steps WHERE job_id = %s ORDER BY done_at, name", (ref,)
        )
    ]
    assert names == ["welcome", "sleep", "nudge", "sleep#2"]


@pytest.mark.server_version
def test_signals_and_waits_that_meet_at_the_same_moment_never_miss_each_other(
    sem: Sem, workers: StartWorkers
) -> None:
    """Each job waits for its own key while the signals are sent from eight connections
    in random order, many of them while their job is still on its way to waiting: every
    job resumes once, with its own payload, and no signal is left over."""
    effects = Effects()
    count = 300

    @sem.app.task(name="waiter")
    async def waiter(n: int) -> Any:
        payload = await skiplock.wait_for_async(f"k:{n}")
        effects(n, "resumed")
        return payload

    ids = sem.enqueue_many([waiter.job(n=n) for n in range(count)])
    workers(2, concurrency=20)
    order = list(range(count))
    random.Random(7).shuffle(order)
    shares = [order[i::8] for i in range(8)]

    def send(share: list[int]) -> None:
        with sem.connect() as conn:
            for n in share:
                sem.app.signal(conn, f"k:{n}", {"n": n})

    senders = [threading.Thread(target=send, args=(share,)) for share in shares]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    sem.wait_for_all(ids, "completed", timeout=60.0)

    results = {job_id: sem.job(job_id).result for job_id in ids}
    assert results == {job_id: {"n": n} for n, job_id in enumerate(ids)}
    assert effects.counts == {(n, "resumed"): 1 for n in range(count)}
    assert kept_signals(sem) == []


def test_a_drain_runs_a_job_to_its_wait_and_on_after_the_signal(sem: Sem) -> None:
    @sem.app.task(name="approve")
    def approve(request: int) -> str:
        decision = skiplock.wait_for(f"decision:{request}")
        return f"request {request}: {decision}"

    with sem.connect() as conn:
        approve.enqueue(conn, request=9)
        [waited] = drain(conn, sem.app)
        assert waited.kind == "waiting"
        sem.app.signal(conn, "decision:9", "approved")
        [done] = drain(conn, sem.app)

    assert done.kind == "completed"
    assert done.result == "request 9: approved"


def test_a_transactional_job_cannot_wait_and_says_why(sem: Sem, workers: StartWorkers) -> None:
    @sem.app.task(name="inside", transactional=True, max_attempts=1)
    def inside(conn: psycopg.Connection[Any]) -> None:
        skiplock.wait_for("anything")

    workers(1)
    ref = sem.enqueue(inside)
    job = sem.wait_for_state(ref, "dead", timeout=PATIENCE)

    message = job.errors[-1]["message"]
    assert "needs a lease-mode job" in message and "transactional" in message, message


def test_an_attempt_that_lost_its_job_neither_waits_nor_sleeps(
    sem: Sem, workers: StartWorkers
) -> None:
    raised: list[str] = []

    @sem.app.task(name="stale", max_attempts=1)
    def stale() -> None:
        job = skiplock.current_job()
        with sem.connect() as conn:  # as a rescue and another worker's claim would
            conn.execute(
                "UPDATE {schema}.jobs SET worker_id = gen_random_uuid() WHERE id = %s".replace(
                    "{schema}", f'"{sem.schema}"'
                ),
                (job.id,),
            )
        for wait in (lambda: skiplock.wait_for("k"), lambda: skiplock.sleep(60)):
            try:
                wait()
            except skiplock.LeaseLostError as exc:
                raised.append(str(exc))

    workers(1, lease_seconds=60.0)
    ref = sem.enqueue(stale)
    wait_until(lambda: len(raised) == 2, PATIENCE, "both calls to raise")

    assert all("no longer holds the job" in message for message in raised), raised
    assert wait_row(sem, ref)[:2] == ("running", None)
    assert sem.execute("SELECT count(*) FROM {schema}.job_steps")[0][0] == 0


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "a non-empty string of at most 180 characters"),
        ("k" * 181, "a non-empty string of at most 180 characters"),
        (42, "a non-empty string of at most 180 characters, got 42"),
        ("nul\x00", "cannot be stored"),
    ],
)
def test_a_signal_key_that_cannot_be_is_refused_at_signal(sem: Sem, key: Any, problem: str) -> None:
    with sem.connect() as conn, pytest.raises(skiplock.ConfigurationError, match=problem):
        sem.app.signal(conn, key, 1)
    assert kept_signals(sem) == []


@pytest.mark.parametrize(
    ("payload", "problem"),
    [(object(), "must be JSON"), (float("nan"), "must be JSON"), ("\ud800", "not storable")],
)
def test_a_payload_json_cannot_hold_is_refused_at_signal(
    sem: Sem, payload: Any, problem: str
) -> None:
    with sem.connect() as conn, pytest.raises(skiplock.ConfigurationError, match=problem):
        sem.app.signal(conn, "key", payload)
    assert kept_signals(sem) == []


@pytest.mark.server_version
def test_sql_signal_refuses_a_key_it_cannot_keep(sem: Sem) -> None:
    with sem.connect() as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="1 to 180 characters"):
            conn.execute(f"SELECT \"{sem.schema}\".signal('', '1')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="kept_for"):
            conn.execute(f"SELECT \"{sem.schema}\".signal('k', '1', interval '-1 day')")
    assert kept_signals(sem) == []


def test_waits_and_sleeps_outside_a_job_or_with_bad_durations_say_so(
    sem: Sem, workers: StartWorkers
) -> None:
    with pytest.raises(RuntimeError, match=r"skiplock.wait_for\(\) called outside a running job"):
        skiplock.wait_for("k")
    with pytest.raises(RuntimeError, match=r"skiplock.sleep\(\) called outside a running job"):
        skiplock.sleep(1)

    @sem.app.task(name="bad_sleep", max_attempts=1)
    def bad_sleep(seconds: Any) -> None:
        skiplock.sleep(seconds)

    workers(1)
    refs = [sem.enqueue(bad_sleep, seconds=s) for s in (-1, "soon")]
    messages = [sem.wait_for_state(r, "dead", timeout=PATIENCE).errors[-1]["message"] for r in refs]
    assert "between 0 and ten years, got -1.0 seconds" in messages[0], messages
    assert "a number of seconds or a timedelta, got 'soon'" in messages[1], messages


def test_expired_signals_are_deleted_by_maintenance(sem: Sem) -> None:
    short = skiplock.App(sem.url, schema=sem.schema, signal_retention=timedelta(seconds=1))
    with sem.connect() as conn:
        short.signal(conn, "old", 1)
        sem.app.signal(conn, "fresh", 2)
        conn.execute(
            f"UPDATE \"{sem.schema}\".signals SET expires_at = now() - interval '1 s' "
            "WHERE key = 'old'"
        )
        report = maintain(conn, sem.schema, retention=None)

    assert report.expired_signals == 1
    assert kept_signals(sem) == [("fresh", 2)]


def test_signal_retention_must_be_a_positive_timedelta(sem: Sem) -> None:
    with pytest.raises(skiplock.ConfigurationError, match="signal_retention"):
        skiplock.App(sem.url, schema=sem.schema, signal_retention=timedelta(0))


def test_status_counts_the_waits_and_the_signals_kept(sem: Sem, run_cli: RunCli) -> None:
    with sem.connect() as conn:
        sem.app.signal(conn, "unheard", json.loads('{"a": 1}'))
    result = run_cli("status")

    assert result.code == 0
    assert "waiting for signals: 0; signals kept: 1" in result.out, result.out


def test_a_workflow_step_that_waits_releases_its_children_once_it_completes(
    sem: Sem, workers: StartWorkers
) -> None:
    @sem.app.task(name="approve_step")
    def approve_step(request: int) -> Any:
        return skiplock.wait_for(f"approved:{request}")

    @sem.app.task(name="publish_step")
    def publish_step() -> Any:
        return skiplock.parent_results()

    wf = sem.app.workflow("review")
    first = wf.add(approve_step.job(request=4), name="approve")
    wf.add(publish_step.job(), name="publish", after=[first])
    with sem.connect() as conn:
        ref = wf.enqueue(conn)
    workers(1)
    approve, publish = ref.steps["approve"], ref.steps["publish"]
    sem.wait_for_state(int(approve), "waiting", timeout=PATIENCE)
    assert wait_row(sem, int(approve))[:2] == ("waiting", "approved:4")
    assert sem.state_of(int(publish)) == "waiting"  # still waiting for its parent

    with sem.connect() as conn:
        sem.app.signal(conn, "approved:4", {"by": "ana"})
    done = sem.wait_for_state(int(publish), "completed", timeout=PATIENCE)

    assert done.result == {"approve": {"by": "ana"}}


def test_the_cli_sends_a_signal_and_says_what_it_did(
    sem: Sem, workers: StartWorkers, run_cli: RunCli
) -> None:
    @sem.app.task(name="shipment")
    def shipment(order: int) -> Any:
        return skiplock.wait_for(f"paid:{order}")

    workers(1)
    ref = sem.enqueue(shipment, order=3)
    sem.wait_for_state(ref, "waiting", timeout=PATIENCE)

    sent = run_cli("signal", "paid:3", '{"total": 9}')
    assert (sent.code, sent.out.strip()) == (0, f"signal 'paid:3' sent: job {ref} resumes")
    assert sem.wait_for_state(ref, "completed", timeout=PATIENCE).result == {"total": 9}

    kept = run_cli("signal", "paid:4", "--keep-days", "2")
    assert kept.code == 0 and "kept: no job waits for it yet" in kept.out, kept.out
    assert kept_signals(sem) == [("paid:4", None)]
    (days,) = sem.execute(
        "SELECT round(extract(epoch FROM expires_at - sent_at) / 86400) FROM {schema}.signals"
    )[0]
    assert int(days) == 2

    bad = run_cli("signal", "paid:5", "{not json")
    assert bad.code == 2 and "PAYLOAD must be JSON" in bad.err, bad.err
    empty = run_cli("signal", "")
    assert empty.code == 2 and "a non-empty string of at most 180 characters" in empty.err
    assert kept_signals(sem) == [("paid:4", None)]


def test_a_wait_written_by_hand_whose_answer_could_not_be_recorded_is_refused(sem: Sem) -> None:
    """A signal or a timeout records the wait's answer under its step name: a row whose
    name job_steps would refuse would fail every signal of its key and every pass of the
    promoter, so the table refuses it."""
    with (
        sem.connect() as conn,
        pytest.raises(psycopg.errors.CheckViolation, match="jobs_wait_valid"),
    ):
        conn.execute(
            f'INSERT INTO "{sem.schema}".jobs (task, state, wait_key, wait_step, wait_until) '
            "VALUES ('t', 'waiting', 'k', repeat('x', 201), now())"
        )


def test_a_wait_whose_job_is_rescued_while_it_parks_leaves_the_rescue_alone(
    sem: Sem, workers: StartWorkers
) -> None:
    """The wait's write queues behind a rescue's uncommitted change of the row: once the
    rescue commits, the fence must refuse the park (the attempt no longer holds its job),
    not overwrite what the rescue wrote."""
    raised: list[str] = []
    rescue_holds = threading.Event()
    committed = threading.Event()

    @sem.app.task(name="rescued", max_attempts=1)
    def rescued() -> None:
        job = skiplock.current_job()

        def rescue() -> None:
            with sem.connect(autocommit=False) as conn:
                conn.execute(
                    f"UPDATE \"{sem.schema}\".jobs SET state = 'available', worker_id = NULL, "
                    "lease_expires_at = NULL, attempts = attempts - 1 WHERE id = %s",
                    (job.id,),
                )
                rescue_holds.set()
                wait_until(
                    lambda: bool(
                        sem.execute(
                            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                            "AND query LIKE '%%wait_key = %%'"
                        )
                    ),
                    PATIENCE,
                    "the wait to queue behind the rescue",
                )
                conn.commit()
                committed.set()

        threading.Thread(target=rescue).start()
        rescue_holds.wait(PATIENCE)
        try:
            skiplock.wait_for("k")
        except skiplock.LeaseLostError as exc:
            raised.append(str(exc))

    workers(1, lease_seconds=60.0)
    ref = sem.enqueue(rescued)
    wait_until(lambda: raised, PATIENCE, "the wait to be refused")

    assert committed.is_set()
    assert "no longer holds the job" in raised[0]
    state, key, _, _, worker = wait_row(sem, ref)
    assert key is None and worker is None and state in ("available", "running"), (state, key)
