"""How long a worker cut off from its database takes to work again once the link returns.

Needs root (skiplock.bench.topology builds the hosts). One worker host, one server; the host's
link is cut for OUTAGE seconds (default 30), restored, and ten jobs enqueued: the figure
is the time from the restore to their completion (docs/cluster.md, "When the link
returns").

    .venv/bin/python scripts/outage.py 60
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

import skiplock
from skiplock.bench.topology import Topology, remove_leftovers, unavailable

SCHEMA = "skiplock_bench"
JOBS = 10


def main() -> int:
    outage = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    reason = unavailable()
    if reason is not None:
        print(f"scripts/outage.py: {reason}", file=sys.stderr)
        return 2
    remove_leftovers()
    topology = Topology(workers=1, tag="outage")
    try:
        topology.up(lambda url: skiplock.App(url, schema=SCHEMA).migrate())
        env = {**os.environ, "SKIPLOCK_DATABASE_URL": topology.primary.url}
        command = [sys.executable, "-m", "skiplock", "--schema", SCHEMA, "worker"]
        command += ["skiplock.bench:app", "--concurrency", "4", "--tcp-user-timeout", "4"]
        log = Path(tempfile.gettempdir()) / "skiplock-outage-worker.log"
        with log.open("wb") as out:
            worker = subprocess.Popen(
                topology.network.run_in("h1", command), env=env, stdout=out, stderr=out
            )
        insert = f"INSERT INTO {SCHEMA}.jobs (task, args) SELECT 'bench.noop', '{{}}'"
        insert += " FROM generate_series(1, %s)"
        with psycopg.connect(topology.primary.local_url(), autocommit=True) as conn:

            def done() -> int:
                row = conn.execute(f"SELECT count(*) FROM {SCHEMA}.job_history").fetchone()
                return 0 if row is None else int(row[0])

            conn.execute(insert, (JOBS,))
            while done() < JOBS:
                time.sleep(0.05)
            topology.network.cut("h1")
            time.sleep(outage)
            topology.network.restore("h1")
            restored = time.monotonic()
            conn.execute(insert, (JOBS,))
            while done() < 2 * JOBS and time.monotonic() - restored < 600:
                time.sleep(0.05)
            back = time.monotonic() - restored
        print(f"outage {outage:g} s: back to work {back:.1f} s after the link returned")
        print(f"(the worker's log: {log})")
        worker.terminate()
        worker.wait(30)
    finally:
        topology.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
