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
    out = subprocess.run(
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
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out)["drain_seconds"])


def scenario(name: str, settings: Settings, report: Report) -> None:
    url, runs = settings.url, settings.runs
    report.figure(Figure("seed (lesson's 400 jobs)", "s", [seed_once(url) for _ in range(runs)]))
    report.figure(Figure("seed, prefetch 0", "s", [seed_once(url, "0") for _ in range(runs)]))
