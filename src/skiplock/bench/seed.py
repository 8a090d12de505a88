"""The ``seed`` scenario: the lesson's 400 jobs, four workers, run by ``skiplock demo
--json``: its drain time by default, and with nothing claimed ahead (``--prefetch 0``),
as the lesson's workers claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from skiplock.bench.measure import Figure, Report, Settings
from skiplock.config import DATABASE_URL_ENV


def seed_once(url: str, prefetch: str = "auto") -> float:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "skiplock",
            "demo",
            "--json",
            "--prefetch",
            prefetch,
        ],
        env={**os.environ, DATABASE_URL_ENV: url},  # not on the command line
        capture_output=True,
        text=True,
        check=False,  # a failure says why, below
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"skiplock demo --prefetch {prefetch} failed (exit {done.returncode}): "
            f"{_failed_checks(done.stdout)}; it said:\n{done.stderr[-3000:]}"
        )
    return float(json.loads(done.stdout)["drain_seconds"])


def _failed_checks(out: str) -> str:
    """The checks a demo's JSON report says failed (it exits 1 when one does)."""
    try:
        checks = json.loads(out)["checks"]
    except (ValueError, KeyError, TypeError):
        return "no report"
    return "failed checks: " + (", ".join(k for k, ok in checks.items() if not ok) or "none")


def scenario(name: str, settings: Settings, report: Report) -> None:
    url, runs = settings.url, settings.runs
    report.figure(Figure("seed (lesson's 400 jobs)", "s", [seed_once(url) for _ in range(runs)]))
    report.figure(Figure("seed, prefetch 0", "s", [seed_once(url, "0") for _ in range(runs)]))
