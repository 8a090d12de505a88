"""Counts and type names in messages, read as English: ``1 job``, ``2 jobs``, ``an
object``. Pure."""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """``1 worker``, ``2 workers``, ``0 workers``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def with_article(noun: str) -> str:
    """``a dict``, ``an object``: the type names errors quote."""
    return f"{'an' if noun and noun[0].lower() in 'aeiou' else 'a'} {noun}"
