"""Figures that the system-level suites (cluster, failover) print after a run and append,
one JSON object per line, to a report file named by an environment variable."""

from __future__ import annotations

import json
import os
from typing import Any


class FigureLog:
    """One suite's figures: recorded by its tests, printed by its conftest's
    ``pytest_terminal_summary`` under ``section``."""

    def __init__(self, section: str, report_env: str) -> None:
        self.section = section
        self.report_env = report_env
        self.figures: list[dict[str, Any]] = []

    def record(self, figures: dict[str, Any]) -> None:
        """Keep a scenario's figures for the summary, and append them to the report file."""
        self.figures.append(figures)
        report = os.environ.get(self.report_env)
        if report:
            with open(report, "a", encoding="utf-8") as out:
                out.write(json.dumps(figures, default=str) + "\n")

    def summary(self, terminalreporter: Any) -> None:
        if not self.figures:
            return
        terminalreporter.section(self.section)
        for figures in self.figures:
            line = ", ".join(
                f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in figures.items()
                if k != "scenario"
            )
            terminalreporter.write_line(f"{figures['scenario']}: {line}")
