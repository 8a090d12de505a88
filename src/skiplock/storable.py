"""Text and JSON that PostgreSQL can store, decided before anything is written.

PostgreSQL's text and jsonb refuse what Python strings and numbers allow: a NUL character
(``\\x00``, or ``\\u0000`` inside jsonb), a lone UTF-16 surrogate (``"\\ud800"``, which is not
a character at all), and numbers JSON has no spelling for (``inf``, ``nan``). One such
value in a batched write fails the whole statement, so every value is checked here, where
the failure can be pinned on the one job it belongs to. Pure: no connection in sight.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from skiplock.errors import ResultNotStorableError

# jsonb numbers are numeric: at most 131,072 digits before the decimal point.
MAX_NUMERIC_DIGITS = 131_072
# How a NUL is shown once removed from a message: visible, and not a NUL.
NUL_SHOWN_AS = "\\x00"


def storable_text(text: str) -> str:
    """``text`` with every NUL and lone surrogate written out as a visible escape
    (``\\x00``, ``\\ud800``), so that it can go into a text or jsonb column. Text that is
    already storable is returned unchanged."""
    if "\x00" in text:
        text = text.replace("\x00", NUL_SHOWN_AS)
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def storable_message(value: object) -> str:
    """``str(value)`` made storable; an object whose ``__str__`` raises is named instead."""
    try:
        text = str(value)
    except Exception as exc:  # a user's __str__ may do anything
        text = f"<{type(value).__qualname__}: str() raised {type(exc).__qualname__}>"
    return storable_text(text)


def problem_in(value: object, path: str = "$") -> str | None:
    """Why ``value`` cannot be stored in jsonb (naming where, as a JSON path), or None.

    Only the values ``json.dumps`` accepts are walked: str, int, float, list, tuple, dict.
    """
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            reason = _text_problem(item)
            if reason is not None:
                return f"the string at {where} {reason}"
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"the number at {where} is {item!r}, which JSON cannot hold"
        elif isinstance(item, int):
            digits, printable = _digits(item), sys.get_int_max_str_digits()
            if digits > MAX_NUMERIC_DIGITS:
                return f"the integer at {where} has more digits than PostgreSQL's numeric holds"
            if printable and digits > printable:
                return f"the integer at {where} has more digits than Python prints ({printable})"
        elif isinstance(item, dict):
            for key, member in item.items():
                if isinstance(key, str):
                    reason = _text_problem(key)
                    if reason is not None:
                        return f"a key at {where} {reason}"
                stack.append((member, f"{where}.{storable_text(str(key))[:40]}"))
        elif isinstance(item, list | tuple):
            stack.extend((member, f"{where}[{i}]") for i, member in enumerate(item))
    return None


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains a NUL character"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "contains a lone surrogate, which is not a character"
    return None


def _digits(number: int) -> int:
    # bit_length() * log10(2), rounded up: no conversion of a huge int to text.
    return math.ceil(abs(number).bit_length() * 0.30103) if number else 1


def encode_result(value: object) -> str | None:
    """A handler's return value as JSON text that jsonb accepts, or None for None.

    A value of a type JSON has no form for (a set, a datetime) is stored as its repr, as
    ``{"repr": "..."}``. A value JSON or jsonb cannot hold (NUL or a lone surrogate in a
    string, inf or nan, a number too long) raises ResultNotStorableError saying where.
    """
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except TypeError:
        return json.dumps({"repr": storable_text(_safe_repr(value))}, ensure_ascii=False)
    except RecursionError:
        raise ResultNotStorableError("result not storable: it is nested too deeply") from None
    except ValueError as exc:
        reason = problem_in(value) or storable_message(exc)
        raise ResultNotStorableError(f"result not storable: {reason}") from None
    # The fast path: nothing json.dumps escaped as \u0000, no surrogate, no huge text.
    suspicious = "\\u0000" in text or not _encodes(text) or len(text) > MAX_NUMERIC_DIGITS
    if suspicious:
        problem = problem_in(value)
        if problem is not None:
            raise ResultNotStorableError(f"result not storable: {problem}")
    return text


def storable_json_text(text: str | None) -> bool:
    """Whether JSON text made elsewhere (``set_progress``) can go into jsonb as it is: no
    NUL and no lone surrogate, raw or escaped. Whether it is JSON at all is not checked."""
    if text is None:
        return True
    # Without a \u escape (a NUL, a surrogate escaped) and with no raw surrogate, it is.
    if "\\u" not in text and _encodes(text):
        return True
    try:
        return problem_in(json.loads(text)) is None
    except ValueError:
        return False


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as exc:  # a user's __repr__ may do anything
        return f"<{type(value).__qualname__}: repr() raised {type(exc).__qualname__}>"


def storable_error(record: dict[str, Any]) -> dict[str, Any]:
    """An error record (executor.error_record) with every string in it made storable."""
    return {
        key: storable_text(value) if isinstance(value, str) else value
        for key, value in record.items()
    }
