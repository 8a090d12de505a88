"""OpenTelemetry traces for enqueues and attempts (the ``otel`` extra; docs/otel.md).

``instrument(app)`` makes every enqueue through the app a ``send`` span (PRODUCER) and
every attempt a worker runs a ``process`` span (CONSUMER), following OpenTelemetry's
messaging semantic conventions. The send span's context is stored with the job (its
``meta`` column, as W3C trace context through the global propagator) and the process span
links to it, or with ``parent=True`` is its child: one trace from the request that
enqueued to the handler, however long the job waited.

Only the OpenTelemetry API is used: spans go wherever the process's tracer provider sends
them, and with no SDK configured they cost next to nothing. Call ``instrument`` in the
module that defines the app, so that the enqueuing processes and the workers both run it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from skiplock import __version__
from skiplock.app import App
from skiplock.tracing import Process, Send, Tracing, error_class
from skiplock.types import ClaimedJob

__all__ = ["OpenTelemetryTracing", "instrument"]

SYSTEM = "skiplock"
# The key of the jobs' meta object under which the trace context is stored.
META_KEY = "trace"


class _Send(Send):
    def __init__(self, span: trace.Span, meta_json: str | None) -> None:
        self._span = span
        self.meta_json = meta_json

    def sent(self, ids: Sequence[int], *, duplicate: bool = False) -> None:
        if len(ids) == 1:
            self._span.set_attribute("messaging.message.id", str(ids[0]))
        if duplicate:
            # A unique key's holder: no job was written, and the holder keeps its own context.
            self._span.set_attribute("skiplock.duplicate", True)


class _Process(Process):
    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self.outcome: str | None = None

    def ended(self, outcome: str, error: Mapping[str, Any] | None) -> None:
        self.outcome = outcome
        self._span.set_attribute("skiplock.outcome", outcome)
        if error is not None:
            self._span.set_attribute("error.type", error_class(error))
            self._span.set_status(Status(StatusCode.ERROR, str(error.get("message") or "")))


class OpenTelemetryTracing(Tracing):
    """Spans through ``tracer_provider`` (default: the global one).

    ``parent=False`` (the default, as the messaging conventions advise) starts each
    process span as the root of a trace of its own, with a link to the send span; a retry
    then does not stretch the enqueuing trace over hours. ``parent=True`` makes it a
    child of the send span instead, for tools that only follow parents.
    """

    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, *, parent: bool = False
    ):
        self._tracer = trace.get_tracer("skiplock", __version__, tracer_provider=tracer_provider)
        self.parent = parent

    @contextmanager
    def send(
        self, queue: str | None, task: str | None, count: int, *, batch: bool
    ) -> Iterator[Send]:
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
        }
        if queue is not None:
            attributes["messaging.destination.name"] = queue
        if task is not None:
            attributes["skiplock.task"] = task
        if batch:
            attributes["messaging.batch.message_count"] = count
        name = f"send {queue}" if queue is not None else "send"
        with self._tracer.start_as_current_span(
            name, kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            yield _Send(span, json.dumps({META_KEY: carrier}) if carrier else None)

    @contextmanager
    def step(self, job: ClaimedJob, name: str, *, replayed: bool) -> Iterator[object]:
        with self._tracer.start_as_current_span(
            f"step {name}",
            kind=SpanKind.INTERNAL,
            attributes={
                "messaging.message.id": str(job.id),
                "skiplock.step.name": name,
                "skiplock.step.replayed": replayed,
            },
        ) as span:
            yield span

    @contextmanager
    def process(self, job: ClaimedJob, attempt: int) -> Iterator[Process]:
        stored, workflow = stored_context(job.meta)
        links: list[Link] = []
        # Not the worker's own context: whatever a previous job left current in this
        # thread must not become this one's parent.
        parent = otel_context.Context()
        if stored is not None:
            span_context = trace.get_current_span(stored).get_span_context()
            if span_context.is_valid:
                if self.parent:
                    parent = stored
                else:
                    links.append(Link(span_context))
        with self._tracer.start_as_current_span(
            f"process {job.queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": job.queue,
                "messaging.message.id": str(job.id),
                "skiplock.task": job.task,
                "skiplock.attempt": attempt,
                **({"skiplock.workflow.id": workflow} if workflow is not None else {}),
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            process = _Process(span)
            try:
                yield process
            except BaseException as exc:
                # A cancelled job's handler is stopped by the cancellation it was asked
                # for: that is its outcome, not an error. Anything else cut the attempt
                # short (the worker stopped, the lease was lost, the session ended).
                if process.outcome != "cancelled":
                    span.record_exception(exc)
                    span.set_attribute(
                        "error.type", f"{type(exc).__module__}.{type(exc).__qualname__}"
                    )
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise


def stored_context(meta: str | None) -> tuple[otel_context.Context | None, int | None]:
    """The trace context a send stored in a job's meta, and the id of the workflow the job
    is a step of (sql.workflows); None for what is not there. A row written by hand may
    hold anything in meta: what cannot be read is ignored, never fatal to the job."""
    if not meta:
        return None, None
    try:
        stored = json.loads(meta)
        carrier = stored.get(META_KEY)
        workflow = stored.get("workflow")
    except (ValueError, AttributeError, RecursionError):
        return None, None
    if not isinstance(workflow, int) or isinstance(workflow, bool):
        workflow = None
    if not isinstance(carrier, dict):
        return None, workflow
    return propagate.extract({str(k): str(v) for k, v in carrier.items()}), workflow


def instrument(
    app: App, tracer_provider: trace.TracerProvider | None = None, *, parent: bool = False
) -> OpenTelemetryTracing:
    """Trace ``app``'s enqueues and the attempts its workers run; returns the tracing."""
    tracing = OpenTelemetryTracing(tracer_provider, parent=parent)
    app.tracing = tracing
    return tracing
