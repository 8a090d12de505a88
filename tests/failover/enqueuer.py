"""The enqueuing application of the failover tests, run on a host (``ip netns exec``) as
``python -m failover.enqueuer`` from the tests folder.

It enqueues the chaos suite's jobs in small transactions through the URL that names both
servers, and writes one JSON line per transaction to ``--out``:

- ``{"ids": [...], "lsn": "0/3000148", "at": 1764...}`` once the commit has returned:
  these jobs must not be lost. ``lsn`` is the primary's WAL position read right after the
  commit (at or past the commit record), null when the server went away before it.
- ``{"in_doubt": 25, "error": "..."}`` when the connection broke during the transaction:
  the commit may or may not have happened, and the client cannot tell which. It does not
  enqueue those jobs again (they could then run twice); the test judges whatever of them
  the new primary holds.

After a broken connection it connects again with back-off for up to ``--patience`` seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import IO, Any

import psycopg

import skiplock
from chaos.chaos_app import app, doomed, work_async, work_sync

# The chaos suite's mix (tests/chaos/test_chaos.py, make_jobs): half async, half sync, one
# in a hundred designed to fail until dead, short handlers.
DOOMED_EVERY = 100
SHORT_MS = (20, 100)
BACKOFF_CAP = 0.5


def job(index: int, rng: random.Random) -> skiplock.JobSpec:
    ms = rng.randint(*SHORT_MS)
    if index % DOOMED_EVERY == DOOMED_EVERY - 1:
        return doomed.job(ms=ms)
    return (work_sync if index % 2 else work_async).job(ms=ms)


def connect(url: str, deadline: float) -> psycopg.Connection[Any]:
    failures = 0
    while True:
        try:
            return psycopg.connect(url, autocommit=True)
        except psycopg.OperationalError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(min(0.05 * 2**failures, BACKOFF_CAP))


def enqueue(args: argparse.Namespace, out: IO[str]) -> None:
    rng = random.Random(args.seed)
    conn: psycopg.Connection[Any] | None = None
    for start in range(0, args.jobs, args.batch):
        specs = [job(i, rng) for i in range(start, min(start + args.batch, args.jobs))]
        line: dict[str, Any]
        try:
            if conn is None or conn.closed:
                conn = connect(args.url, time.monotonic() + args.patience)
            with conn.transaction():
                ids = app.enqueue_many(conn, specs)
            line = {"ids": ids, "lsn": None, "at": time.time()}
            try:
                row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                line["lsn"] = None if row is None else row[0]
            except psycopg.OperationalError:
                conn.close()
        except psycopg.OperationalError as exc:
            line = {"in_doubt": len(specs), "error": str(exc).strip()[:200]}
            if conn is not None:
                conn.close()
        out.write(json.dumps(line) + "\n")
        out.flush()
        time.sleep(args.interval)
    if conn is not None:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between commits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patience", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as out:
        enqueue(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
