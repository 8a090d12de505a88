"""OpenTelemetry: send spans at enqueue, process spans per attempt, the context between them
stored in the job's meta column. A real database and a real worker; spans are read from
the SDK's in-memory exporter, through a tracer provider of the test's own (never the
process's global one)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from psycopg import sql

import skiplock
from conftest import SCHEMA, JobFactory, StartWorker, wait_until
from skiplock.contrib.otel import OpenTelemetryTracing, instrument, stored_context
from skiplock.retry import RetryPolicy

QUICK_RETRY = RetryPolicy(base=0.001, cap=0.001, jitter=0.0)
FAST = {"poll_interval": 0.05, "rescue_interval": 0.05}


class Traces:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [
            span for span in self.exporter.get_finished_spans() if name is None or span.name == name
        ]

    def one(self, name: str) -> ReadableSpan:
        found = self.spans(name)
        assert len(found) == 1, [s.name for s in self.spans()]
        return found[0]


@pytest.fixture
def traces() -> Iterator[Traces]:
    found = Traces()
    yield found
    found.provider.shutdown()


def meta_of(app: skiplock.App, job_id: int, table: str = "jobs") -> Any:
    with psycopg.connect(app.database_url) as conn:
        row = conn.execute(
            sql.SQL("SELECT meta FROM {} WHERE id = %s").format(sql.Identifier(SCHEMA, table)),
            (job_id,),
        ).fetchone()
    assert row is not None, f"job {job_id} is not in {table}"
    return row[0]


def attribute(span: ReadableSpan, name: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(name)


def trace_id_of(meta: dict[str, Any]) -> int:
    context, _ = stored_context(json.dumps(meta))
    assert context is not None
    from opentelemetry import trace  # noqa: PLC0415

    return trace.get_current_span(context).get_span_context().trace_id


def test_an_enqueue_is_a_producer_span_whose_context_is_stored_with_the_job(
    app: skiplock.App, traces: Traces
) -> None:
    instrument(app, traces.provider)
    send_email = app.task(name="send_email", queue="emails")(lambda to: None)

    with psycopg.connect(app.database_url) as conn:
        job_id = int(send_email.enqueue(conn, to="a@example.com"))
        conn.commit()

    span = traces.one("send emails")
    assert span.kind is SpanKind.PRODUCER
    assert span.attributes is not None
    assert dict(span.attributes) == {
        "messaging.system": "skiplock",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "emails",
        "skiplock.task": "send_email",
        "messaging.message.id": str(job_id),
    }
    meta = meta_of(app, job_id)
    assert span.context is not None
    assert trace_id_of(meta) == span.context.trace_id
    assert set(meta) == {"trace"}
    with psycopg.connect(app.database_url) as conn:  # and the arguments are untouched
        assert skiplock.client.get_job(conn, app.schema, job_id).args == {"to": "a@example.com"}


def test_a_workflow_is_one_send_span_and_each_step_links_to_it_naming_the_workflow(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)
    step = app.task(name="step")(lambda n: n)

    with psycopg.connect(app.database_url) as conn:
        ref = skiplock.chain(step.job(n=1), step.job(n=2), app=app).enqueue(conn)
        conn.commit()
    send = traces.one("send default")
    assert attribute(send, "messaging.batch.message_count") == 2
    worker = start_worker(app, **FAST)
    wait_until(lambda: len(traces.spans("process default")) == 2, what="both steps to run")
    worker.stop()

    assert send.context is not None
    for process in traces.spans("process default"):
        assert attribute(process, "skiplock.workflow.id") == ref.id
        assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert stored_context('{"workflow": true}') == (None, None)  # written by hand: ignored


def test_without_tracing_nothing_is_stored(app: skiplock.App) -> None:
    task = app.task(name="plain")(lambda: None)
    with psycopg.connect(app.database_url) as conn:
        job_id = int(task.enqueue(conn))
        ids = app.enqueue_many(conn, [task.job() for _ in range(3)])
        conn.commit()

    assert meta_of(app, job_id) is None
    assert all(meta_of(app, i) is None for i in ids)


def test_the_process_span_links_to_the_send_span_and_holds_the_handlers_spans(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)
    inner = traces.provider.get_tracer("test")

    @app.task(name="resize")
    def resize(size: int) -> int:
        with inner.start_as_current_span("inside the handler"):
            return size * 2

    with psycopg.connect(app.database_url) as conn:
        job_id = int(resize.enqueue(conn, size=3))
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: traces.spans("inside the handler"), what="the handler to run")
    wait_until(lambda: traces.spans("process default"), what="the process span to end")
    worker.stop()

    send, process = traces.one("send default"), traces.one("process default")
    assert process.kind is SpanKind.CONSUMER
    assert process.attributes is not None
    assert process.attributes["messaging.system"] == "skiplock"
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.attributes["messaging.destination.name"] == "default"
    assert process.attributes["messaging.message.id"] == str(job_id)
    assert process.attributes["skiplock.task"] == "resize"
    assert process.attributes["skiplock.attempt"] == 1
    assert process.attributes["skiplock.outcome"] == "completed"
    assert "error.type" not in process.attributes
    # A trace of its own, linked to the enqueue's (the conventions' default).
    assert send.context is not None and process.context is not None
    assert process.parent is None
    assert process.context.trace_id != send.context.trace_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    # The sync handler ran in a thread, and its span is the process span's child.
    handler = traces.one("inside the handler")
    assert handler.parent is not None
    assert handler.parent.span_id == process.context.span_id
    # The meta moved to history with the job.
    assert meta_of(app, job_id, "job_history") is not None


def test_with_parent_the_process_span_is_a_child_of_the_send_span(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider, parent=True)

    @app.task(name="child")
    async def child() -> None:
        return None

    with psycopg.connect(app.database_url) as conn:
        child.enqueue(conn)
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: traces.spans("process default"), what="the job to run")
    worker.stop()

    send, process = traces.one("send default"), traces.one("process default")
    assert send.context is not None and process.context is not None
    assert process.parent is not None
    assert process.parent.span_id == send.context.span_id
    assert process.context.trace_id == send.context.trace_id
    assert not process.links


def test_each_attempt_is_a_span_and_a_failure_names_its_error_type(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)

    class PaymentDeclinedError(Exception):
        pass

    @app.task(name="charge", max_attempts=2, retry=QUICK_RETRY)
    def charge() -> None:
        raise PaymentDeclinedError("card declined")

    with psycopg.connect(app.database_url) as conn:
        job_id = int(charge.enqueue(conn))
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: len(traces.spans("process default")) == 2, what="both attempts")
    worker.stop()

    spans = sorted(traces.spans("process default"), key=lambda s: attribute(s, "skiplock.attempt"))
    outcomes = [s.attributes["skiplock.outcome"] if s.attributes else None for s in spans]
    assert outcomes == ["retried", "dead"]
    for span in spans:
        assert span.attributes is not None
        assert span.attributes["messaging.message.id"] == str(job_id)
        assert span.attributes["error.type"] == (
            f"{__name__}.test_each_attempt_is_a_span_and_a_failure_names_its_error_type"
            ".<locals>.PaymentDeclinedError"
        )
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "card declined"
    # Both attempts link to the one enqueue.
    send = traces.one("send default")
    assert send.context is not None
    assert all(s.links[0].context.span_id == send.context.span_id for s in spans)


def test_a_bulk_enqueue_is_one_send_span_and_every_path_stores_the_context(
    app: skiplock.App, traces: Traces
) -> None:
    instrument(app, traces.provider)
    plain = app.task(name="plain", queue="bulk")(lambda n: None)
    unique = app.task(name="unique", queue="bulk", unique=True)(lambda n: None)
    windowed = app.task(name="windowed", queue="bulk", unique=True, unique_window=60)(
        lambda n: None
    )
    keyed = plain.with_options(ordering_key="customer-1")

    batches = {
        "copy": [plain.job(n=n) for n in range(3)],
        "copy, keyed": [keyed.job(n=n) for n in range(2)],
        "unique": [unique.job(n=n) for n in range(2)],
        "windowed": [windowed.job(n=n) for n in range(2)],
    }
    ids: dict[str, list[int]] = {}
    with psycopg.connect(app.database_url) as conn:
        for name, specs in batches.items():
            ids[name] = app.enqueue_many(conn, specs)
        single_windowed = int(windowed.enqueue(conn, n=99))
        conn.commit()

    sends = traces.spans("send bulk")
    assert len(sends) == len(batches) + 1
    counts = [attribute(s, "messaging.batch.message_count") for s in sends]
    assert sorted(c for c in counts if c is not None) == [2, 2, 2, 3]
    trace_ids = set()
    for name, job_ids in ids.items():
        for job_id in job_ids:
            meta = meta_of(app, job_id)
            assert meta is not None, f"{name}: job {job_id} has no meta"
            trace_ids.add(trace_id_of(meta))
    assert meta_of(app, single_windowed) is not None
    assert trace_ids == {s.context.trace_id for s in sends if s.context} - {
        trace_id_of(meta_of(app, single_windowed))
    }


def test_async_enqueues_are_traced_too(app: skiplock.App, traces: Traces) -> None:
    instrument(app, traces.provider)
    task = app.task(name="later", queue="async")(lambda: None)

    async def enqueue() -> tuple[int, list[int]]:
        async with await psycopg.AsyncConnection.connect(app.database_url) as conn:
            job_id = int(await task.enqueue_async(conn))
            ids = await app.enqueue_many_async(conn, [task.job(), task.job()])
            await conn.commit()
        return job_id, ids

    job_id, ids = asyncio.run(enqueue())

    assert len(traces.spans("send async")) == 2
    assert all(meta_of(app, i) is not None for i in [job_id, *ids])


def test_a_duplicate_is_marked_and_keeps_the_holders_context(
    app: skiplock.App, traces: Traces
) -> None:
    instrument(app, traces.provider)
    once = app.task(name="once", unique=True)(lambda: None)
    with psycopg.connect(app.database_url) as conn:
        first = int(once.enqueue(conn))
        second = int(once.enqueue(conn))
        conn.commit()

    assert first == second
    first_send, second_send = traces.spans("send default")
    assert second_send.attributes is not None
    assert second_send.attributes["skiplock.duplicate"] is True
    assert first_send.context is not None
    assert trace_id_of(meta_of(app, first)) == first_send.context.trace_id


def test_unreadable_meta_written_by_hand_does_not_cost_the_job(
    app: skiplock.App, traces: Traces, start_worker: StartWorker, make_job: JobFactory
) -> None:
    app.tracing = OpenTelemetryTracing(traces.provider)
    app.task(name="noop")(lambda: None)
    job_ids = [make_job(task="noop") for _ in range(3)]
    garbage = ['"a string"', '{"trace": 5}', '{"trace": {"traceparent": "nonsense"}}']
    with psycopg.connect(app.database_url) as conn:
        for job_id, meta in zip(job_ids, garbage, strict=True):
            conn.execute(
                sql.SQL("UPDATE {} SET meta = %s::jsonb WHERE id = %s").format(
                    sql.Identifier(SCHEMA, "jobs")
                ),
                (meta, job_id),
            )
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: len(traces.spans("process default")) == 3, what="every job to run")
    worker.stop()

    for span in traces.spans("process default"):
        assert not span.links
        assert span.attributes is not None
        assert span.attributes["skiplock.outcome"] == "completed"


def test_transactional_attempts_are_process_spans_too(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)
    inner = traces.provider.get_tracer("test")

    @app.task(name="tx_sync", transactional=True)
    def tx_sync(conn: psycopg.Connection[Any]) -> None:
        with inner.start_as_current_span("inside tx_sync"):
            conn.execute("SELECT 1")

    @app.task(name="tx_async", transactional=True, max_attempts=1)
    async def tx_async(conn: psycopg.AsyncConnection[Any]) -> None:
        with inner.start_as_current_span("inside tx_async"):
            raise LookupError("not there")

    with psycopg.connect(app.database_url) as conn:
        tx_sync.enqueue(conn)
        tx_async.enqueue(conn)
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: len(traces.spans("process default")) == 2, what="both jobs to run")
    worker.stop()

    by_task = {attribute(s, "skiplock.task"): s for s in traces.spans("process default")}
    sync_span, async_span = by_task["tx_sync"], by_task["tx_async"]
    # Transactional attempts count from the row's attempts before this one.
    assert attribute(sync_span, "skiplock.attempt") == 1
    assert attribute(sync_span, "skiplock.outcome") == "completed"
    assert attribute(async_span, "skiplock.outcome") == "dead"
    assert attribute(async_span, "error.type") == "LookupError"
    for task, span in (("tx_sync", sync_span), ("tx_async", async_span)):
        handler = traces.one(f"inside {task}")
        assert span.context is not None and handler.parent is not None
        assert handler.parent.span_id == span.context.span_id
        assert [link.context.span_id for link in span.links] == [
            s.context.span_id
            for s in traces.spans("send default")
            if s.context and attribute(s, "skiplock.task") == task
        ]


def test_a_cancelled_attempt_ends_its_span_cancelled_not_failed(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)
    started = threading.Event()

    @app.task(name="forever_async")
    async def forever_async() -> None:
        started.set()
        await asyncio.sleep(60)

    @app.task(name="polite_sync")
    def polite_sync() -> None:
        started.set()
        while not skiplock.cancel_requested():
            time.sleep(0.01)

    def ended(name: str) -> bool:
        return any(attribute(s, "skiplock.task") == name for s in traces.spans("process default"))

    worker = start_worker(app, **FAST)
    for task in (forever_async, polite_sync):
        started.clear()
        with psycopg.connect(app.database_url) as conn:
            job_id = int(task.enqueue(conn))
            conn.commit()
        assert started.wait(10), f"{task.name} did not start"
        with psycopg.connect(app.database_url) as conn:
            skiplock.client.cancel_job(conn, app.schema, job_id)
            conn.commit()
        wait_until(partial(ended, task.name), what=f"{task.name} to end")
    worker.stop()

    for span in traces.spans("process default"):
        assert attribute(span, "skiplock.outcome") == "cancelled"
        assert attribute(span, "error.type") is None
        assert span.status.status_code is not StatusCode.ERROR


def test_each_durable_step_is_a_span_inside_its_attempt_replayed_ones_marked(
    app: skiplock.App, traces: Traces, start_worker: StartWorker
) -> None:
    instrument(app, traces.provider)

    @app.task(name="checkout", max_attempts=2, retry=QUICK_RETRY)
    def checkout() -> str:
        charge = skiplock.step("charge", lambda: "ch_1")
        if skiplock.current_job().attempts == 1:
            raise RuntimeError("the webhook is down")
        return str(skiplock.step("webhook", lambda: charge))

    with psycopg.connect(app.database_url) as conn:
        checkout.enqueue(conn)
        conn.commit()
    worker = start_worker(app, **FAST)
    wait_until(lambda: len(traces.spans("process default")) == 2, what="both attempts")
    worker.stop()

    first, second = sorted(traces.spans("process default"), key=lambda s: s.start_time or 0)
    charges = sorted(traces.spans("step charge"), key=lambda s: s.start_time or 0)
    assert [attribute(s, "skiplock.step.replayed") for s in charges] == [False, True]
    assert first.context is not None and second.context is not None
    assert [s.parent.span_id for s in charges if s.parent] == [
        first.context.span_id,
        second.context.span_id,
    ]
    webhook = traces.one("step webhook")
    assert attribute(webhook, "skiplock.step.name") == "webhook"
    assert webhook.parent is not None
    assert webhook.parent.span_id == second.context.span_id
