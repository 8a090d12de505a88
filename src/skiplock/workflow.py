"""Workflows: jobs that run after other jobs (decision 024).

``app.workflow("name")`` builds one step at a time; ``chain``, ``group`` and ``chord`` are
shorthands that compose. Everything is checked while it is built, nothing is written
until ``enqueue(conn)``, which sends the whole workflow in one statement in ``conn``'s
transaction and never commits. A step whose parents have not all completed waits outside
the claim; the statement that ends its last parent releases it (migration 0022).
Inside a step, ``parent_results()`` gives its parents' return values by step name.

The building and the statement's parameters are pure; the sync and async shells only
execute (house rule 2: no logic twice).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import psycopg

from skiplock.client.params import SCHEMA_MISSING, schema_not_ready
from skiplock.context import current_job
from skiplock.errors import ConfigurationError, EnqueueError, JobFailedError
from skiplock.results import JobRef
from skiplock.sql import render
from skiplock.sql import workflows as statements
from skiplock.tasks import MAX_TASK_NAME, JobSpec
from skiplock.tracing import Send

if TYPE_CHECKING:
    from skiplock.app import App

# At least 10,000 must work (issue 23); one statement carries them all, and a workflow
# past this is better split (or built as a batch, later).
MAX_STEPS = 100_000
MAX_STEP_NAME = MAX_TASK_NAME

# Every App made in this process, oldest first, so that a workflow built with the
# shorthands (which know no App) and parent_results() (which runs inside a handler) find
# the App of their tasks.
_apps: list[weakref.ref[App]] = []


def register_app(app: App) -> None:
    """Called by App.__init__."""
    _apps[:] = [ref for ref in _apps if ref() is not None]
    _apps.append(weakref.ref(app))


def _apps_with(tasks: set[str]) -> list[App]:
    """The live Apps that have every one of ``tasks``, newest first."""
    found = []
    for ref in reversed(_apps):
        app = ref()
        if app is not None and tasks <= app.tasks.keys():
            found.append(app)
    return found


@dataclass(frozen=True, eq=False)
class Step:
    """A step of one workflow, as ``Workflow.add`` returns it: what ``after=`` takes."""

    workflow: Workflow
    name: str
    index: int

    def __repr__(self) -> str:
        return f"<Step {self.name!r} of {self.workflow!r}>"


Parent = Union[Step, str, "Workflow"]


@dataclass(frozen=True)
class WorkflowRef:
    """An enqueued workflow: its id, and each step's JobRef by step name."""

    id: int
    steps: Mapping[str, JobRef]

    def __int__(self) -> int:
        return self.id


@dataclass(frozen=True, slots=True)
class _Node:
    spec: JobSpec
    name: str
    parents: tuple[int, ...]
    run_anyway: bool | None
    # Named by the caller (kept when copied into another workflow, numbered if taken
    # there); otherwise named after its task, and named afresh when copied.
    named: bool


class Workflow:
    """A graph of jobs built step by step, then enqueued at once.

    ``run_anyway=True`` runs every step once its parents have ended, whatever they ended
    as (a step can say so too); by default a step whose parent ends dead or cancelled is
    cancelled, with what depends on it. ``app`` is found from the steps' tasks when not
    given (the shorthands know none)."""

    def __init__(
        self, name: str | None = None, *, app: App | None = None, run_anyway: bool = False
    ) -> None:
        if name is not None:
            _check_text("workflow name", name)
        if not isinstance(run_anyway, bool):
            raise ConfigurationError(f"run_anyway must be True or False, got {run_anyway!r}")
        self.name = name
        self.app = app
        self.run_anyway = run_anyway
        self._nodes: list[_Node] = []
        self._by_name: dict[str, int] = {}
        # A step that stands for a copied workflow's last steps: its index -> theirs.
        self._groups: dict[int, tuple[int, ...]] = {}
        self._numbers: dict[str, int] = {}
        self._enqueued = False

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Workflow{label} of {len(self._nodes)} steps>"

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def step_names(self) -> list[str]:
        """The steps' names, in the order they were added."""
        return [node.name for node in self._nodes]

    def add(
        self,
        job: JobSpec | Workflow,
        *,
        name: str | None = None,
        after: Iterable[Parent] = (),
        run_anyway: bool | None = None,
    ) -> Step:
        """Add ``job`` (from ``task.job(...)``), to run after every step in ``after``
        (steps of this workflow, their names, or a workflow added here: its last steps).
        ``name`` defaults to the task's, numbered if taken. A whole workflow may be added
        too: its steps are copied in, the roots after ``after``; the step returned stands
        for its last steps (pass it on in ``after``)."""
        self._check_open()
        parents = self._parents(after)
        if isinstance(job, Workflow):
            return self._add_workflow(job, parents, name)
        if not isinstance(job, JobSpec):
            raise ConfigurationError(
                f"a workflow step is a job from task.job(...), got {type(job).__name__}"
            )
        _check_unique_step(name or job.task, job)
        if run_anyway is not None and not isinstance(run_anyway, bool):
            raise ConfigurationError(f"run_anyway must be True or False, got {run_anyway!r}")
        return self._append(
            job, self._name(name, job.task), parents, run_anyway, named=name is not None
        )

    def _append(
        self,
        spec: JobSpec,
        name: str,
        parents: tuple[int, ...],
        run_anyway: bool | None,
        *,
        named: bool,
    ) -> Step:
        if len(self._nodes) >= MAX_STEPS:
            raise ConfigurationError(
                f"a workflow holds at most {MAX_STEPS:,} steps; split it into several"
            )
        index = len(self._nodes)
        self._nodes.append(_Node(spec, name, parents, run_anyway, named))
        self._by_name[name] = index
        return Step(self, name, index)

    def _name(self, given: str | None, task: str, *, copied: bool = False) -> str:
        if given is not None and not (copied and given in self._by_name):
            _check_text("step name", given)
            if given in self._by_name:
                raise ConfigurationError(
                    f"this workflow already has a step named {given!r}; step names are unique"
                )
            return given
        task = given or task
        if task not in self._by_name:
            return task
        # Numbered from 2, remembering where each name got to: a chain of one task
        # is not quadratic in its length.
        number = self._numbers.get(task, 2)
        while f"{task}#{number}" in self._by_name:
            number += 1
        self._numbers[task] = number + 1
        return f"{task}#{number}"

    def _parents(self, after: Iterable[Parent]) -> tuple[int, ...]:
        if isinstance(after, (str, Step, Workflow)):
            after = [after]
        found: dict[int, None] = {}
        for parent in after:
            for index in self._resolve(parent):
                found[index] = None
        return tuple(found)

    def _resolve(self, parent: object) -> list[int]:
        if isinstance(parent, Step):
            if parent.workflow is not self:
                raise ConfigurationError(
                    f"step {parent.name!r} belongs to another workflow: after= takes steps "
                    "of this one (add the other workflow here to compose them)"
                )
            return self._leaves_of(parent)
        if isinstance(parent, str):
            if parent not in self._by_name:
                raise ConfigurationError(
                    f"after={parent!r}: this workflow has no step of that name "
                    f"(it has {', '.join(map(repr, self._by_name)) or 'none yet'})"
                )
            return [self._by_name[parent]]
        if isinstance(parent, Workflow):
            raise ConfigurationError(
                "after= takes steps of this workflow; add the other workflow first "
                "(wf.add(other)) and pass the step that returns"
            )
        raise ConfigurationError(
            f"after= takes steps (what add returns) or step names, got {type(parent).__name__}"
        )

    def _leaves_of(self, step: Step) -> list[int]:
        return list(self._groups.get(step.index, (step.index,)))

    def _add_workflow(self, other: Workflow, parents: tuple[int, ...], name: str | None) -> Step:
        if other is self:
            raise ConfigurationError("a workflow cannot contain itself")
        if not other._nodes:
            raise ConfigurationError("cannot add an empty workflow")
        if self.app is None:
            self.app = other.app
        offset: dict[int, int] = {}
        for index, node in enumerate(other._nodes):
            mapped = tuple(offset[p] for p in node.parents) if node.parents else parents
            run_anyway = other.run_anyway if node.run_anyway is None else node.run_anyway
            step = self._append(
                node.spec,
                self._name(node.name if node.named else None, node.spec.task, copied=True),
                mapped,
                run_anyway or None,
                named=node.named,
            )
            offset[index] = step.index
        leaves = [offset[i] for i in other._leaf_indexes()]
        # The step returned stands for the copied workflow's last steps.
        marker = leaves[-1]
        self._groups[marker] = tuple(leaves)
        del name  # a copied workflow keeps its steps' own names
        return Step(self, self._nodes[marker].name, marker)

    def _leaf_indexes(self) -> list[int]:
        """The steps nothing else here runs after."""
        has_children = {p for node in self._nodes for p in node.parents}
        return [i for i in range(len(self._nodes)) if i not in has_children]

    def _check_open(self) -> None:
        if self._enqueued:
            raise ConfigurationError(
                "this workflow was enqueued already; build a new one to add steps"
            )

    # -- enqueue --------------------------------------------------------------------------

    def _owner(self) -> App:
        if self.app is not None:
            return self.app
        apps = _apps_with({node.spec.task for node in self._nodes})
        if len(apps) != 1:
            raise ConfigurationError(
                "cannot tell which App this workflow's tasks belong to; build it with "
                "app.workflow(...) or pass app= to chain/group/chord"
            )
        return apps[0]

    def _params(self) -> dict[str, Any]:
        """The statement's parameters, the graph checked; nothing is written."""
        if not self._nodes:
            raise ConfigurationError("a workflow needs at least one step (wf.add(task.job()))")
        check_acyclic([node.parents for node in self._nodes])
        return workflow_params(self.name, self._nodes, self.run_anyway)

    def _traced(self, app: App) -> AbstractContextManager[Send | None]:
        """The send span of the whole workflow, when ``app`` traces; its context goes in
        every step's meta, so that each step's process span links to it."""
        if app.tracing is None:
            return contextlib.nullcontext()
        queues = set(self._queues())
        return app.tracing.send(
            queues.pop() if len(queues) == 1 else None, None, len(self._nodes), batch=True
        )

    def enqueue(self, conn: psycopg.Connection[Any]) -> WorkflowRef:
        """Write the workflow in ``conn``'s transaction, in one statement (never commits)."""
        app = owner = self._owner()
        params = self._params()
        if app.queue_databases:  # every step on conn's database; refs wait there
            owner = app._result_app(app._route(conn, self._queues()))
        with self._traced(app) as send:
            params["meta"] = send.meta_json if send is not None else None
            try:
                cur = conn.execute(render(statements.WORKFLOW_INSERT, app.schema), params)
            except SCHEMA_MISSING as exc:
                raise schema_not_ready(app.schema, exc) from exc
            except psycopg.errors.UniqueViolation as exc:
                raise _held(exc) from None
            ref = self._enqueued_as(owner, cur.fetchone())
            if send is not None:
                send.sent(list(ref.steps.values()))
        return ref

    async def enqueue_async(self, conn: psycopg.AsyncConnection[Any]) -> WorkflowRef:
        """``enqueue`` on an async connection."""
        app = owner = self._owner()
        params = self._params()
        if app.queue_databases:
            owner = app._result_app(await app._route_async(conn, self._queues()))
        with self._traced(app) as send:
            params["meta"] = send.meta_json if send is not None else None
            try:
                cur = await conn.execute(render(statements.WORKFLOW_INSERT, app.schema), params)
            except SCHEMA_MISSING as exc:
                raise schema_not_ready(app.schema, exc) from exc
            except psycopg.errors.UniqueViolation as exc:
                raise _held(exc) from None
            ref = self._enqueued_as(owner, await cur.fetchone())
            if send is not None:
                send.sent(list(ref.steps.values()))
        return ref

    def _queues(self) -> list[str]:
        return sorted({node.spec.queue for node in self._nodes})

    def _enqueued_as(self, app: App, row: Sequence[Any] | None) -> WorkflowRef:
        assert row is not None
        workflow_id, ids, written = row
        if len(ids) != len(self._nodes) or written != len(self._nodes):  # pragma: no cover
            raise RuntimeError(f"a workflow of {len(self._nodes)} steps wrote {written}")
        self._enqueued = True
        return WorkflowRef(
            int(workflow_id),
            {node.name: JobRef(int(i), app) for node, i in zip(self._nodes, ids, strict=True)},
        )


def _held(exc: psycopg.errors.UniqueViolation) -> Exception:
    """A unique step whose key a live job holds (or another step of the workflow): the
    whole workflow is refused. Any other violation is not ours to word."""
    if exc.diag.constraint_name != "jobs_unique_active":
        return exc
    detail = (exc.diag.message_detail or "").strip()
    return EnqueueError(
        f"a unique step's key is held already ({detail}): nothing of this workflow was "
        "written, and the transaction is aborted (enqueue in conn.transaction() to go on)"
    )


def _check_unique_step(name: str, job: JobSpec) -> None:
    """A unique step holds its key from its enqueue, waiting included: only the 'active'
    scope, whose index covers every live state, can say so. A 'queued' key would be
    taken only when the step is released, by its parent's completion, which must not
    fail on it; a window outlives the job."""
    if job.unique_key is None:
        return
    if job.replace:
        raise ConfigurationError(
            f"step {name!r}: a workflow step cannot replace or debounce (replace=, "
            "debounce=): a held key refuses the whole workflow, whose steps are written "
            "together"
        )
    if job.unique_scope != "active" or job.unique_window is not None:
        raise ConfigurationError(
            f"step {name!r}: a workflow step may be unique in the 'active' scope only "
            "(no unique_scope='queued', no unique_window): it holds its key from the "
            "workflow's enqueue on, while it waits for its parents too"
        )


def _check_text(kind: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_STEP_NAME:
        raise ConfigurationError(
            f"{kind} must be a non-empty string of at most {MAX_STEP_NAME} characters, "
            f"got {value!r}"
        )


def check_acyclic(parents: Sequence[Sequence[int]]) -> None:
    """Raise ConfigurationError naming a step on a cycle, or a parent that is not a step.
    ``parents[i]`` are step i's parents' indexes. Steps added through ``add`` can only
    name earlier steps, so this guards what else might build the lists."""
    count = len(parents)
    ordered = True
    for index, own in enumerate(parents):
        for parent in own:
            if not 0 <= parent < count:
                raise ConfigurationError(f"step {index} names an unknown parent {parent}")
            if parent == index:
                raise ConfigurationError(f"step {index} depends on itself")
            ordered = ordered and parent < index
    if ordered:
        return  # every step after its parents (as add builds them): no cycle
    # Kahn's algorithm: every step whose parents are all placed is placed next.
    children: list[list[int]] = [[] for _ in range(count)]
    waiting = [len(set(own)) for own in parents]
    for index, own in enumerate(parents):
        for parent in set(own):
            children[parent].append(index)
    ready = [i for i in range(count) if waiting[i] == 0]
    placed = 0
    while ready:
        index = ready.pop()
        placed += 1
        for child in children[index]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if placed != count:
        stuck = next(i for i in range(count) if waiting[i] > 0)
        raise ConfigurationError(f"the workflow has a cycle through step {stuck}")


def step_columns(nodes: Sequence[_Node], run_anyway: bool) -> dict[str, Any]:
    """The steps as one object of columns (sql.workflows._GIVEN reads it): an array per
    column, parents and children as arrays of step numbers (from 1) in PostgreSQL's text
    form, "{1,2}". A column with one value for every step is sent once, under "all"
    (most are: a workflow's steps mostly share queue, options and keys): it halved the
    JSON of a 10,000-step workflow. Names differ, so there is always one array."""
    children: list[list[str]] = [[] for _ in nodes]
    for index, node in enumerate(nodes):
        own = str(index + 1)
        for parent in node.parents:
            children[parent].append(own)
    specs = [node.spec for node in nodes]
    rates = [spec.key_rate or (None, None) for spec in specs]
    columns: dict[str, Any] = {
        "q": [s.queue for s in specs],
        "t": [s.task for s in specs],
        "a": [s.args_json for s in specs],
        "p": [s.priority for s in specs],
        "r": [s.run_at.isoformat() if s.run_at is not None else None for s in specs],
        "d": [s.delay for s in specs],
        "m": [s.max_attempts for s in specs],
        "ok": [s.ordering_key for s in specs],
        "kl": [s.key_limit for s in specs],
        "kr": [rate for rate, _ in rates],
        "kp": [period for _, period in rates],
        "w": [len(node.parents) for node in nodes],
        "uk": [s.unique_key for s in specs],
        "name": [node.name for node in nodes],
        "anyway": [run_anyway if node.run_anyway is None else node.run_anyway for node in nodes],
        "up": ["{" + ",".join([str(p + 1) for p in node.parents]) + "}" for node in nodes],
        "down": ["{" + ",".join(own) + "}" for own in children],
        "tg": [json.dumps(s.tags) if s.tags else None for s in specs],
    }
    uniform = {
        key: values[0]
        for key, values in columns.items()
        if key != "name" and values.count(values[0]) == len(values)
    }
    for key in uniform:
        del columns[key]
    columns["all"] = uniform
    return columns


def workflow_params(name: str | None, nodes: Sequence[_Node], run_anyway: bool) -> dict[str, Any]:
    """WORKFLOW_INSERT's parameters."""
    return {
        "name": name,
        "options": json.dumps({"run_anyway": run_anyway}),
        "steps": len(nodes),
        "given": json.dumps(step_columns(nodes, run_anyway)),
    }


# -- the shorthands ---------------------------------------------------------------------

Member = JobSpec | Workflow


def chain(*members: Member, app: App | None = None) -> Workflow:
    """Each member after the one before (a member: a job, or a workflow such as a group)."""
    workflow = Workflow(app=app)
    previous: Step | None = None
    for member in members:
        previous = workflow.add(member, after=[previous] if previous is not None else [])
    return workflow


def group(*members: Member, app: App | None = None) -> Workflow:
    """The members side by side, none waiting for another."""
    workflow = Workflow(app=app)
    for member in members:
        workflow.add(member)
    return workflow


def chord(members: Member, callback: JobSpec, *, app: App | None = None) -> Workflow:
    """``callback`` after every step of ``members`` (usually a group) has completed."""
    workflow = Workflow(app=app)
    last = workflow.add(members)
    workflow.add(callback, after=[last])
    return workflow


# -- inside a step ----------------------------------------------------------------------


def _results(rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, state, result, last_error in rows:
        if state == "completed":
            results[name] = result
        else:
            error = last_error or {}
            detail = f": {error.get('type', 'Error')}: {error.get('message', '')}" if error else ""
            results[name] = JobFailedError(f"parent step {name!r} is {state}{detail}")
    return results


def _running_app() -> tuple[App, int, str]:
    """The App of the running step: the newest with its task (a process usually has one;
    with several, pass a connection to parent_results)."""
    job = current_job()
    apps = _apps_with({job.task})
    if not apps:  # pragma: no cover - the worker runs only tasks of an App
        raise RuntimeError(f"no App in this process has task {job.task!r}")
    return apps[0], job.id, job.queue


def running_step_rows(template: str, conn: psycopg.Connection[Any] | None) -> list[Any]:
    """Rows of ``template`` for the running job (``%(id)s``), read through ``conn`` or a
    short connection of the job's App."""
    app, job_id, queue = _running_app()
    statement = render(template, app.schema)
    if conn is not None:
        return conn.execute(statement, {"id": job_id}).fetchall()
    with psycopg.connect(app.database_url_for(queue), autocommit=True) as own:
        return own.execute(statement, {"id": job_id}).fetchall()


async def running_step_rows_async(
    template: str, conn: psycopg.AsyncConnection[Any] | None
) -> list[Any]:
    """``running_step_rows`` on an async connection."""
    app, job_id, queue = _running_app()
    statement = render(template, app.schema)
    if conn is not None:
        return await (await conn.execute(statement, {"id": job_id})).fetchall()
    async with await psycopg.AsyncConnection.connect(
        app.database_url_for(queue), autocommit=True
    ) as own:
        return await (await own.execute(statement, {"id": job_id})).fetchall()


def parent_results(conn: psycopg.Connection[Any] | None = None) -> dict[str, Any]:
    """Inside a step: its parents' return values by step name, read from the database
    (``conn``, or a short connection of the step's App). A parent that ended dead or
    cancelled (a step that runs anyway) is a JobFailedError saying how; a job that is
    not a workflow step has no parents ({})."""
    return _results(running_step_rows(statements.STEP_PARENT_RESULTS, conn))


async def parent_results_async(
    conn: psycopg.AsyncConnection[Any] | None = None,
) -> dict[str, Any]:
    """``parent_results`` for async handlers."""
    return _results(await running_step_rows_async(statements.STEP_PARENT_RESULTS, conn))
