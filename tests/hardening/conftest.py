"""Fixtures for the hardening tests: the semantics suite's schema of its own per test
(``sem``) and its real workers (``workers``), see tests/semantics/conftest.py."""

from __future__ import annotations

from semantics.conftest import sem, workers

__all__ = ["sem", "workers"]
