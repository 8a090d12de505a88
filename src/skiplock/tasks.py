"""Task definitions: options validated when the task is defined, arguments when enqueued.

Everything here is pure: the App (through ``client``) does the writing, so this module
imports neither of them (the layers in pyproject.toml).
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeGuard, TypeVar

from skiplock.errors import ConfigurationError, EnqueueError
from skiplock.retry import RetryPolicy
from skiplock.wording import with_article

if TYPE_CHECKING:
    import psycopg

    from skiplock.app import App
    from skiplock.results import JobRef

R = TypeVar("R")

_NAME = re.compile(r"^[A-Za-z0-9_.:\-]+$")
MAX_QUEUE_NAME = 128
MAX_TASK_NAME = 255
# Tags (stored in the job's meta, indexed in jobs and history: migration 0032).
MAX_TAG = 64
MAX_TAGS = 16
PRIORITY_RANGE = (-32768, 32767)
MAX_ARGS_BYTES = 64 * 1024 * 1024


def check_name(kind: str, value: object, max_length: int) -> str:
    """Queue and task names: short, printable, safe in logs, CLIs and NOTIFY payloads."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{kind} name must be a non-empty string, got {value!r}")
    if len(value) > max_length:
        raise ConfigurationError(f"{kind} name is {len(value)} characters; at most {max_length}")
    if not _NAME.fullmatch(value):
        raise ConfigurationError(
            f"{kind} name {value!r} may only contain letters, digits and '_', '.', ':', '-'"
        )
    return value


@dataclass(frozen=True)
class TaskOptions:
    """Per-task defaults; each can be overridden per call where it makes sense.

    Lower ``priority`` values run first (0 is the default; use negative for urgent work).
    """

    queue: str = "default"
    priority: int = 0
    max_attempts: int = 3
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    transactional: bool = False
    timeout: float | None = None
    # True: the key is the task name and its arguments. A string: that key, for every call.
    unique: bool | str = False
    unique_scope: str = "active"
    # Seconds after an enqueue during which a duplicate is refused whatever became of the
    # first job (it may have finished long ago). None: the scope alone decides.
    unique_window: float | timedelta | None = None
    # A held key replaces instead of refusing (decision 028): the waiting holder takes
    # this job's values of the fields named (True: all of REPLACEABLE).
    replace: bool | tuple[str, ...] = False
    # Seconds: the job runs this long after the last enqueue of its key; each duplicate
    # pushes the waiting holder's run time back. Keys are then held while a job waits
    # (unique_scope 'queued'), so a change made while one runs gets a job of its own.
    debounce: float | timedelta | None = None
    # Labels to find the task's jobs by (`jobs list --tag`, the dashboard); a call's own
    # tags= replace these.
    tags: tuple[str, ...] = ()


_OPTION_NAMES = ("name", *TaskOptions.__dataclass_fields__)
_CALL_OPTION_NAMES = (
    "queue",
    "priority",
    "max_attempts",
    "run_at",
    "delay",
    "unique_key",
    "unique_scope",
    "unique_window",
    "replace",
    "debounce",
    "tags",
    "ordering_key",
    "concurrency_key",
    "concurrency_limit",
    "rate_key",
    "rate_limit",
)
UNIQUE_SCOPES = ("active", "queued")
# What a replacing enqueue may change in a waiting holder (migration 0031).
REPLACEABLE = ("args", "run_at", "priority", "max_attempts")


def _reject_unknown(given: Mapping[str, object], known: tuple[str, ...], where: str) -> None:
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" - did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
            raise ConfigurationError(f"unknown {where} option {key!r}{hint}")


def _check_priority(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigurationError(f"priority must be an integer, got {value!r}")
    low, high = PRIORITY_RANGE
    if not low <= value <= high:
        raise ConfigurationError(f"priority must be between {low} and {high}, got {value}")
    return value


MAX_ATTEMPTS_LIMIT = 2**31 - 1  # the column is an integer
MAX_DELAY_SECONDS = 100 * 365 * 24 * 3600.0


def _is_count(value: object, most: int) -> TypeGuard[int]:
    """A whole number from 1 to ``most`` (True and False are not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def _check_max_attempts(value: object) -> int:
    if not _is_count(value, MAX_ATTEMPTS_LIMIT):
        raise ConfigurationError(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT:,}, got {value!r}"
        )
    return value


def parse_task_options(options: Mapping[str, Any]) -> tuple[str | None, TaskOptions]:
    """Validate ``@app.task(...)`` keywords, failing early with a suggestion for typos."""
    _reject_unknown(options, _OPTION_NAMES, "task")
    name = options.get("name")
    if name is not None:
        check_name("task", name, MAX_TASK_NAME)
    parsed = TaskOptions(**{k: v for k, v in options.items() if k != "name"})
    check_name("queue", parsed.queue, MAX_QUEUE_NAME)
    _check_priority(parsed.priority)
    _check_max_attempts(parsed.max_attempts)
    if not isinstance(parsed.retry, RetryPolicy):
        raise ConfigurationError(f"retry must be a skiplock.RetryPolicy, got {parsed.retry!r}")
    _check_unique(parsed.unique_scope, parsed.unique)
    if parsed.unique_window is not None:
        if parsed.unique is False:
            raise ConfigurationError("unique_window needs unique=True or a unique key")
        parsed = replace(parsed, unique_window=_check_window(parsed.unique_window))
    parsed = _parse_replacing(parsed, scope_given="unique_scope" in options)
    parsed = replace(parsed, tags=check_tags(parsed.tags))
    if parsed.timeout is not None and not (
        isinstance(parsed.timeout, (int, float)) and parsed.timeout > 0
    ):
        raise ConfigurationError(
            f"timeout must be a positive number of seconds, got {parsed.timeout!r}"
        )
    return name, parsed


def _check_window(value: object, name: str = "unique_window") -> float:
    """A window in seconds, from a number or a timedelta."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        not isinstance(seconds, (int, float))
        or isinstance(seconds, bool)
        or not (math.isfinite(seconds) and 0 < seconds <= MAX_DELAY_SECONDS)
    ):
        raise ConfigurationError(
            f"{name} must be a positive number of seconds or a timedelta of at most "
            f"100 years, got {value!r}"
        )
    return float(seconds)


def check_tags(value: object) -> tuple[str, ...]:
    """``tags=``: a list of short names, each kept once, in order."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        example = f" (one tag: tags=[{value!r}])" if isinstance(value, str) else ""
        raise ConfigurationError(f"tags must be a list of strings, got {value!r}{example}")
    tags = tuple(dict.fromkeys(check_name("tag", tag, MAX_TAG) for tag in value))
    if len(tags) > MAX_TAGS:
        raise ConfigurationError(f"a job has at most {MAX_TAGS} tags, got {len(tags)}")
    return tags


def check_replace(value: object) -> tuple[str, ...]:
    """``replace=``: True (every field), False, or the names of fields to replace."""
    if value is True:
        return REPLACEABLE
    if value is False or value is None or value == ():
        return ()
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigurationError(
            f"replace must be True or some of {', '.join(REPLACEABLE)}, got {value!r}"
        )
    for name in names:
        if name not in REPLACEABLE:
            close = difflib.get_close_matches(str(name), REPLACEABLE, n=1)
            hint = f" - did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(
                f"replace: {name!r} cannot be replaced; choose from {', '.join(REPLACEABLE)}{hint}"
            )
    return tuple(dict.fromkeys(str(name) for name in names))


def _parse_replacing(parsed: TaskOptions, *, scope_given: bool) -> TaskOptions:
    """The task's ``replace`` and ``debounce``, checked against its unique key."""
    fields = check_replace(parsed.replace)
    debounce = None if parsed.debounce is None else _check_window(parsed.debounce, "debounce")
    if not fields and debounce is None:
        return replace(parsed, replace=())
    which = "debounce" if debounce is not None else "replace"
    if parsed.unique is False:
        raise ConfigurationError(f"{which} needs unique=True or a unique key")
    if parsed.unique_window is not None:
        raise ConfigurationError(
            f"{which} cannot be combined with unique_window: a window's holder may have "
            "finished long ago, and a finished job has nothing to replace"
        )
    scope = parsed.unique_scope
    if debounce is not None:
        _check_debounce_scope(scope if scope_given else None)
        scope = "queued"
    return replace(parsed, replace=fields, debounce=debounce, unique_scope=scope)


def _check_debounce_scope(scope: object) -> None:
    if scope == "active":
        raise ConfigurationError(
            "debounce holds its key only while the job waits (unique_scope='queued'), so "
            "that a change made while one runs gets a job of its own; leave unique_scope "
            "out or give 'queued'"
        )


def _check_unique(scope: object, key: object) -> None:
    if scope not in UNIQUE_SCOPES:
        raise ConfigurationError(
            f"unique_scope={scope!r}: choose 'active' (no duplicate while one waits or "
            "runs) or 'queued' (no duplicate while one waits)"
        )
    if not isinstance(key, (bool, str)) or key == "":
        raise ConfigurationError(f"a unique key must be a non-empty string, got {key!r}")
    if isinstance(key, str):
        problem = _json_problem(key, f"unique key {key!r}", [])
        if problem:
            raise ConfigurationError(problem)


def _json_problem(value: object, path: str, large: list[float]) -> str | None:
    """Why ``value`` cannot be stored as JSON in PostgreSQL, or None when it can. Floats
    that Python writes with a positive exponent are collected in ``large``."""
    if value is None or isinstance(value, (bool, int)):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{path} is {value!r}, which JSON cannot hold"
        if "e+" in repr(value):
            large.append(value)
        return None
    if isinstance(value, str):
        if "\x00" in value:
            return f"{path} contains a NUL character, which PostgreSQL jsonb cannot store"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{path} contains a lone surrogate and is not valid Unicode"
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = _json_problem(item, f"{path}[{index}]", large)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{path} has a non-string key {key!r}"
            problem = _json_problem(key, f"{path} key {key!r}", large) or _json_problem(
                item, f"{path}[{key!r}]", large
            )
            if problem:
                return problem
        return None
    kind = with_article(type(value).__name__)
    return f"{path} is {kind}, which is not JSON (pass ids, not objects)"


_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
_KEY_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), sort_keys=True)


def _exact_floats(value: Any, texts: dict[str, str]) -> Any:
    """``value`` with each exponent-written float replaced by a placeholder string whose
    JSON is swapped for the float's plain decimal text afterwards (see encode_args)."""
    if isinstance(value, float) and "e+" in repr(value):
        marker = f"\x01skiplock-float-{len(texts)}\x01"
        plain = format(Decimal(repr(value)), "f")
        texts[_ENCODER.encode(marker)] = plain if "." in plain else plain + ".0"
        return marker
    if isinstance(value, (list, tuple)):
        return [_exact_floats(item, texts) for item in value]
    if isinstance(value, dict):
        return {key: _exact_floats(item, texts) for key, item in value.items()}
    return value


def encode_args(task_name: str, args: Mapping[str, Any]) -> str:
    """Arguments as a JSON object, or an EnqueueError naming the argument that cannot be.

    PostgreSQL's jsonb stores 1e+23 as 100000000000000000000000, which reads back as an
    int; such floats are written with a decimal point instead, so they come back as the
    same float."""
    if not args:
        return "{}"
    # The C encoder first (the walk of every value costs more than the encoding): its
    # ASCII-only text shows everything the walk would refuse or rewrite. A NUL is written
    # \u0000 and a surrogate \udXXX; a float with an exponent contains "e+"; a nested
    # object (whose keys the encoder would quietly turn into strings) opens a second "{";
    # any other value that cannot be stored makes the encoder raise. At any such sign,
    # the walk decides, and so finds and names the argument.
    try:
        encoded = _ENCODER.encode(args)
    except (TypeError, ValueError, RecursionError):
        return _encode_args_walked(task_name, args)
    if "\\u0000" in encoded or "\\ud" in encoded or "e+" in encoded or encoded.find("{", 1) > 0:
        return _encode_args_walked(task_name, args)
    return _checked_size(task_name, encoded)


def _encode_args_walked(task_name: str, args: Mapping[str, Any]) -> str:
    large: list[float] = []
    for key, value in args.items():
        try:
            problem = _json_problem(key, f"argument name {key!r}", large) or _json_problem(
                value, f"argument {key!r}", large
            )
        except RecursionError:
            problem = f"argument {key!r} is nested too deeply to store"
        if problem:
            raise EnqueueError(f"cannot enqueue {task_name}: {problem}")
    try:
        if large:
            texts: dict[str, str] = {}
            encoded = _ENCODER.encode(_exact_floats(dict(args), texts))
            for marker, plain in texts.items():
                encoded = encoded.replace(marker, plain)
        else:
            encoded = _ENCODER.encode(args)
    except ValueError:  # an int past Python's int-to-str digit limit
        for key, value in args.items():
            try:
                _ENCODER.encode(value)
            except ValueError as exc:
                raise EnqueueError(f"cannot enqueue {task_name}: argument {key!r}: {exc}") from None
        raise
    return _checked_size(task_name, encoded)


def _checked_size(task_name: str, encoded: str) -> str:
    if len(encoded) > MAX_ARGS_BYTES:
        raise EnqueueError(
            f"cannot enqueue {task_name}: arguments are {len(encoded)} bytes of JSON; "
            f"the limit is {MAX_ARGS_BYTES} (store large data elsewhere and pass a key)"
        )
    return encoded


@dataclass(frozen=True)
class JobSpec:
    """One job ready to insert: validated, JSON-encoded, nothing written yet."""

    task: str
    args_json: str
    queue: str
    priority: int
    max_attempts: int
    run_at: datetime | None = None
    delay: float = 0.0
    unique_key: str | None = None
    unique_scope: str = "active"
    unique_window: float | None = None
    # A held key replaces these fields of the waiting holder (decision 028).
    replace: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    # Keyed jobs wait their turn outside the claim (migration 0008): at most key_limit of
    # a key's jobs are admitted at once, oldest first.
    ordering_key: str | None = None
    key_limit: int = 1
    # (jobs, seconds): at most that many of the key's jobs admitted per period.
    key_rate: tuple[int, float] | None = None


_RATE = re.compile(
    r"^\s*(\d+)\s*/\s*(\d+(?:\.\d*)?|\.\d+)?\s*(s|sec|second|m|min|minute|h|hour|d|day)s?\s*$"
)
_UNIT_SECONDS = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}


def parse_rate(text: str) -> tuple[int, float]:
    """'100/s', '10/5s', '600/1m', '1000/hour' -> (jobs, period in seconds)."""
    match = _RATE.match(text)
    if match is None:
        raise ConfigurationError(
            f"rate {text!r}: write jobs/period, e.g. 100/s, 10/5s, 600/minute or 1000/h"
        )
    jobs, amount, unit = int(match[1]), match[2], match[3]
    period = (float(amount) if amount else 1.0) * _UNIT_SECONDS[unit]
    if jobs < 1 or jobs > 2**31 - 1 or not (0 < period <= MAX_DELAY_SECONDS):
        raise ConfigurationError(
            f"rate {text!r}: needs 1 to {2**31 - 1} jobs per period of more than 0 s and "
            "at most 100 years"
        )
    return jobs, period


MAX_KEY_LENGTH = 255
MAX_KEY_LIMIT = 2**15 - 1  # the column is a smallint


def _check_key(option: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"{option} must be a non-empty string of at most {MAX_KEY_LENGTH} characters, "
            f"got {value!r}"
        )
    return value


_KEY_OPTIONS = ("ordering_key", "concurrency_key", "rate_key")


def _check_keys(options: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """One key per job: ordering_key, concurrency_key (with concurrency_limit) or
    rate_key; rate_limit goes with any of them. ``current``: the options already given
    to this call (a key given earlier takes a limit given now)."""
    given = [k for k in _KEY_OPTIONS if options.get(k)]
    held = given or [k for k in _KEY_OPTIONS if current.get(k)]
    for name in ("ordering_key", "concurrency_key", "rate_key"):
        if name in options and options[name] is not None:
            _check_key(name, options[name])
    if len(given) > 1:
        raise ConfigurationError(
            f"give one of ordering_key, concurrency_key or rate_key, not {' and '.join(given)}:"
            " a job has one key (its limits go in concurrency_limit and rate_limit)"
        )
    if "concurrency_limit" in options:
        limit = options["concurrency_limit"]
        if "concurrency_key" not in held:
            raise ConfigurationError(
                "concurrency_limit needs a concurrency_key to count by"
                + (" (an ordering_key runs one job at a time)" if held else "")
            )
        if not _is_count(limit, MAX_KEY_LIMIT):
            raise ConfigurationError(
                f"concurrency_limit must be an integer from 1 to {MAX_KEY_LIMIT}, got {limit!r}"
            )
    if "rate_limit" in options:
        if not held:
            raise ConfigurationError(
                "rate_limit needs a key to count by: rate_key, concurrency_key or ordering_key"
            )
        check_rate(options["rate_limit"])
    elif options.get("rate_key") is not None and current.get("rate_limit") is None:
        raise ConfigurationError("rate_key needs a rate_limit, e.g. rate_limit='100/minute'")


def check_rate(value: object) -> tuple[int, float]:
    """A rate as '100/minute' or (jobs, seconds)."""
    if isinstance(value, str):
        return parse_rate(value)
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], int)
        and not isinstance(value[0], bool)
        and 1 <= value[0] <= 2**31 - 1
        and isinstance(value[1], (int, float))
        and not isinstance(value[1], bool)
        and math.isfinite(value[1])
        and 0 < value[1] <= MAX_DELAY_SECONDS
    ):
        return value[0], float(value[1])
    raise ConfigurationError(
        f"a rate must be jobs/period such as '100/s' or '600/minute', or (jobs, seconds) with "
        f"1 to {2**31 - 1} jobs and a period of at most 100 years; got {value!r}"
    )


def _window_or_none(value: float | timedelta | None) -> float | None:
    return value.total_seconds() if isinstance(value, timedelta) else value


def argument_mismatch(
    given: Collection[str],
    accepted: Collection[str],
    required: Collection[str],
    *,
    takes_any: bool = False,
) -> str:
    """Every way ``given`` keyword arguments miss a handler's parameters, in one sentence.

    Python's own TypeError names only the first problem, so ``orderid=1`` for
    ``order_id`` reads as a missing ``order_id`` alone; naming the unexpected keyword
    (with the parameter it is probably a typo of) shows the typo at once."""
    unexpected = [] if takes_any else sorted(k for k in given if k not in accepted)
    missing = sorted(k for k in required if k not in given)
    parts = []
    for key in unexpected:
        close = difflib.get_close_matches(key, missing or sorted(accepted), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parts.append(f"unexpected keyword argument {key!r}{hint}")
    if len(missing) == 1:
        parts.append(f"missing a required argument: {missing[0]!r}")
    elif missing:
        parts.append("missing required arguments: " + ", ".join(repr(k) for k in missing))
    return "; ".join(parts) or "arguments do not fit the handler"


class Task(Generic[R]):
    """A registered handler. Call it to run it inline; ``enqueue`` to run it later."""

    def __init__(self, app: App, fn: Callable[..., R], name: str, options: TaskOptions) -> None:
        self.app = app
        self.fn = fn
        self.name = name
        self.options = options
        self.is_async = inspect.iscoroutinefunction(fn)
        self._signature = inspect.signature(fn)
        self._check_signature()
        # For the fast argument check: bulk enqueue checks every job.
        params = list(self._signature.parameters.values())[1 if options.transactional else 0 :]
        self._takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._names = frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD)
        self._required = frozenset(
            p.name for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD
        )
        self._default_call: TaskCall[R] = TaskCall(self)

    def _check_signature(self) -> None:
        params = list(self._signature.parameters.values())
        if self.options.transactional:
            if not params or params[0].kind not in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                raise ConfigurationError(
                    f"transactional task {self.name!r} must take the connection as its first "
                    "positional parameter, e.g. def handler(conn, order_id): ..."
                )
            params = params[1:]
        for param in params:
            if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
                raise ConfigurationError(
                    f"task {self.name!r}: parameter {param.name!r} cannot be passed by keyword; "
                    "job arguments are stored as a JSON object of named values"
                )

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Task {self.name} queue={self.options.queue}>"

    def check_args(self, args: Mapping[str, Any]) -> None:
        """Raise EnqueueError naming the argument when ``args`` does not fit the handler."""
        keys = args.keys()
        if (self._takes_any or keys <= self._names) and self._required <= keys:
            return
        # Slow path, only to word the error.
        problem = argument_mismatch(keys, self._names, self._required, takes_any=self._takes_any)
        raise EnqueueError(f"cannot enqueue {self.name}: {problem}")

    def with_options(self, /, **options: Any) -> TaskCall[R]:
        """Override queue, priority, max_attempts, run_at or delay for the next enqueue,
        or give it a unique key, an ordering key or a concurrency key and limit."""
        return self._default_call.with_options(**options)

    def job(self, /, **args: Any) -> JobSpec:
        """A validated job for ``App.enqueue_many``."""
        return self._default_call.job(**args)

    def enqueue(self, conn: psycopg.Connection[Any], /, **args: Any) -> JobRef:
        """Insert the job in ``conn``'s current transaction; never commits. Returns its id
        (a ``JobRef``: an int that can also wait for the job's result)."""
        return self._default_call.enqueue(conn, **args)

    async def enqueue_async(self, conn: psycopg.AsyncConnection[Any], /, **args: Any) -> JobRef:
        """Async twin of ``enqueue``."""
        return await self._default_call.enqueue_async(conn, **args)


def _job_spec(fixed: JobSpec, **fields: Any) -> JobSpec:
    """``fixed`` with the job's own ``fields``, made without the frozen dataclass's
    __init__ (as ``replace`` would run it), which sets each of 13 fields through
    object.__setattr__: a third of the time to build a job. The fields were checked when
    ``fixed`` was made and when the arguments were encoded."""
    spec = JobSpec.__new__(JobSpec)
    vars(spec).update(vars(fixed), **fields)
    return spec


@dataclass(frozen=True)
class TaskCall(Generic[R]):
    """A task with per-call options applied."""

    task: Task[R]
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    run_at: datetime | None = None
    delay: float = 0.0
    unique_key: str | None = None
    unique_scope: str | None = None
    unique_window: float | timedelta | None = None
    replace: bool | tuple[str, ...] | None = None
    tags: tuple[str, ...] | None = None
    debounce: float | timedelta | None = None
    ordering_key: str | None = None
    concurrency_key: str | None = None
    concurrency_limit: int = 1
    rate_key: str | None = None
    rate_limit: tuple[int, float] | str | None = None

    def with_options(self, /, **options: Any) -> TaskCall[R]:
        _reject_unknown(options, _CALL_OPTION_NAMES, "enqueue")
        _check_keys(options, {k: getattr(self, k) for k in (*_KEY_OPTIONS, "rate_limit")})
        if "unique_key" in options or "unique_scope" in options:
            key = options.get("unique_key")
            if key is not None and not isinstance(key, str):
                raise ConfigurationError(f"a unique key must be a non-empty string, got {key!r}")
            _check_unique(options.get("unique_scope", "active"), True if key is None else key)
        if options.get("unique_window") is not None:
            options = {**options, "unique_window": _check_window(options["unique_window"])}
        if "replace" in options:
            options = {**options, "replace": check_replace(options["replace"])}
        if "tags" in options:
            options = {**options, "tags": check_tags(options["tags"])}
        if options.get("debounce") is not None:
            options = {**options, "debounce": _check_window(options["debounce"], "debounce")}
            _check_debounce_scope(options.get("unique_scope"))
            if options.get("run_at") is not None or options.get("delay"):
                raise ConfigurationError(
                    "debounce sets the run time (now + debounce): give it or run_at/delay, not both"
                )
        if "queue" in options:
            check_name("queue", options["queue"], MAX_QUEUE_NAME)
            declared = self.task.options.queue
            if self.task.options.transactional and options["queue"] != declared:
                # A worker's transactional sessions claim, per queue, the tasks that name
                # it: on any other queue the job would wait for ever.
                raise ConfigurationError(
                    f"task {self.task.name!r} is transactional and runs on its queue "
                    f"{declared!r}, not {options['queue']!r}; register a task for that "
                    "queue (@app.task(queue=..., transactional=True))"
                )
        if "priority" in options:
            _check_priority(options["priority"])
        if "max_attempts" in options:
            _check_max_attempts(options["max_attempts"])
        run_at = options.get("run_at")
        if run_at is not None and (not isinstance(run_at, datetime) or run_at.tzinfo is None):
            raise ConfigurationError(f"run_at must be a timezone-aware datetime, got {run_at!r}")
        delay = options.get("delay", 0.0)
        if (
            not isinstance(delay, (int, float))
            or isinstance(delay, bool)
            or not (math.isfinite(delay) and 0 <= delay <= MAX_DELAY_SECONDS)
        ):
            raise ConfigurationError(
                f"delay must be a number of seconds from 0 to {MAX_DELAY_SECONDS:.0f} "
                f"(100 years), got {delay!r}"
            )
        if run_at is not None and "delay" in options:
            raise ConfigurationError("give run_at or delay, not both")
        # A later key replaces an earlier one of another kind: a job has one key.
        cleared: dict[str, Any] = {"ordering_key": None, "rate_key": None}
        cleared.update(concurrency_key=None, concurrency_limit=1)
        for name in ("ordering_key", "concurrency_key", "rate_key"):
            if options.get(name) is not None:
                options = {**{k: v for k, v in cleared.items() if k != name}, **options}
        if options.get("rate_limit") is not None:
            options = {**options, "rate_limit": check_rate(options["rate_limit"])}
        return replace(self, **options)

    def job(self, /, **args: Any) -> JobSpec:
        task = self.task
        task.check_args(args)
        args_json = encode_args(task.name, args)
        fixed = self._fixed
        if fixed.unique_key is None and task.options.unique is True:
            # The task and its arguments (keys sorted) are the key.
            unique_key = f"{task.name}:{_KEY_ENCODER.encode(args)}"
            return _job_spec(fixed, args_json=args_json, unique_key=unique_key)
        return _job_spec(fixed, args_json=args_json)

    @cached_property
    def _fixed(self) -> JobSpec:
        """What every job of this call shares (all but its arguments, and its unique key
        when the arguments make it), decided once for all of the call's jobs."""
        task = self.task
        unique_key = self.unique_key
        if unique_key is None and isinstance(task.options.unique, str):
            unique_key = task.options.unique
        keyed_by_args = unique_key is None and task.options.unique is True
        key_rate = check_rate(self.rate_limit) if self.rate_limit is not None else None
        key_limit = 1
        if self.concurrency_key:
            key_limit = self.concurrency_limit
        elif self.rate_key and key_rate is not None:
            # A rate key alone also runs at most its rate's count at once: admitted jobs
            # that wait for a worker then start together at most that many at a time.
            key_limit = min(key_rate[0], MAX_KEY_LIMIT)
        if unique_key is None and not keyed_by_args and self.unique_window is not None:
            raise ConfigurationError(
                f"{task.name}: unique_window needs a unique_key (or a task with unique=...)"
            )
        unique = unique_key is not None or keyed_by_args
        window = _window_or_none(self.unique_window or task.options.unique_window)
        fields, debounce, scope = self._replacing(unique, window)
        return JobSpec(
            task=task.name,
            args_json="{}",
            unique_key=unique_key,
            unique_scope=scope,
            unique_window=window if unique else None,
            replace=fields,
            tags=task.options.tags if self.tags is None else self.tags,
            queue=self.queue or task.options.queue,
            priority=task.options.priority if self.priority is None else self.priority,
            max_attempts=self.max_attempts or task.options.max_attempts,
            run_at=None if debounce is not None else self.run_at,
            delay=float(self.delay) if debounce is None else debounce,
            ordering_key=self.ordering_key or self.concurrency_key or self.rate_key,
            key_limit=key_limit,
            key_rate=key_rate,
        )

    def _replacing(
        self, unique: bool, window: float | None
    ) -> tuple[tuple[str, ...], float | None, str]:
        """The fields a held key replaces, the debounce, and the key's scope, from this
        call's options over the task's."""
        task = self.task
        fields = check_replace(task.options.replace if self.replace is None else self.replace)
        debounce = _window_or_none(
            self.debounce if self.debounce is not None else task.options.debounce
        )
        scope = self.unique_scope or task.options.unique_scope
        if not fields and debounce is None:
            return (), None, scope
        which = "debounce" if debounce is not None else "replace"
        if not unique:
            raise ConfigurationError(
                f"{task.name}: {which} needs a unique_key (or a task with unique=...)"
            )
        if window is not None:
            raise ConfigurationError(
                f"{task.name}: {which} cannot be combined with unique_window: a window's "
                "holder may have finished long ago, and a finished job has nothing to replace"
            )
        if debounce is not None:
            if self.debounce is None and (self.run_at is not None or self.delay):
                raise ConfigurationError(
                    f"{task.name} debounces: its run time is now + {debounce:g}s, so give "
                    "no run_at or delay"
                )
            _check_debounce_scope(self.unique_scope)
            fields = tuple(dict.fromkeys((*fields, "run_at")))
            scope = "queued"
        return fields, debounce, scope

    # The App writes the job: tasks sit below client and app and never import them.
    def enqueue(self, conn: psycopg.Connection[Any], /, **args: Any) -> JobRef:
        return self.task.app._enqueue_spec(conn, self.job(**args))

    async def enqueue_async(self, conn: psycopg.AsyncConnection[Any], /, **args: Any) -> JobRef:
        return await self.task.app._enqueue_spec_async(conn, self.job(**args))
