"""The traceback stored with a failed attempt, without the frames that called the handler.

A handler's exception reaches the executor through skiplock's own frames, asyncio's event
loop and, for a sync handler, the thread pool: a dozen frames that are the same for every
job and push the handler's own lines out of view (and out of the stored length limit).
Those leading frames are replaced by one line saying how many were left out. Frames after
the handler's first one are kept whoever owns them: they are the path from the user's
code to the raise. A traceback with no frame outside skiplock and asyncio (a fault in
skiplock itself) is kept whole, since there is nothing else to debug it with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import traceback
from collections.abc import Sequence

_STANDARD_LIBRARY = os.path.dirname(os.path.dirname(asyncio.__file__ or ""))

# Where the frames that call a handler live: this package, asyncio's event loop, and the
# thread pool that runs sync handlers. Prefixes of a frame's file name.
INTERNAL_DIRECTORIES: tuple[str, ...] = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(asyncio.__file__ or "") + os.sep,
    os.path.dirname(concurrent.futures.__file__ or "") + os.sep,
    os.path.join(_STANDARD_LIBRARY, "threading.py"),
)


def is_internal(filename: str, internal: Sequence[str] = INTERNAL_DIRECTORIES) -> bool:
    """Whether a frame's file belongs to skiplock, asyncio or the thread pool."""
    return filename.startswith(tuple(internal))


class _TrimmedStack(traceback.StackSummary):
    """A stack whose leading internal frames are left out, with a line saying so."""

    omitted = 0

    def format(self) -> list[str]:
        lines = super().format()
        if self.omitted:
            noun = "frame" if self.omitted == 1 else "frames"
            lines.insert(0, f"  [{self.omitted} {noun} of skiplock and asyncio omitted]\n")
        return lines


def _trim(stack: traceback.StackSummary, internal: Sequence[str]) -> traceback.StackSummary:
    first_own = next(
        (i for i, frame in enumerate(stack) if not is_internal(frame.filename, internal)), None
    )
    if not first_own:  # None: nothing but internals (keep all); 0: nothing to leave out
        return stack
    trimmed = _TrimmedStack(list(stack)[first_own:])  # from_list would make a plain one
    trimmed.omitted = first_own
    return trimmed


def format_handler_exception(
    exc: BaseException, internal: Sequence[str] = INTERNAL_DIRECTORIES
) -> str:
    """``traceback.format_exception`` of ``exc`` (with its causes and contexts), each
    stack without the internal frames before the handler's first own frame."""
    report = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending = [report]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = _trim(current.stack, internal)
        pending += [c for c in (current.__cause__, current.__context__) if c is not None]
        pending += getattr(current, "exceptions", None) or []
    return "".join(report.format())
