"""``skiplock worker --processes N``: the supervisor and its worker processes, all real
processes on a real PostgreSQL. A stop signal ends every one of them, even when it arrives
while a dead child is being replaced, and every child runs with the options given."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

import skiplock
from conftest import wait_until
from test_smoke import CommandLines

ROOT = Path(__file__).resolve().parent.parent
WORKER_APP = "tests.crash_app:app"  # no job is enqueued on its queue: nothing runs


class Supervisor:
    """``skiplock worker --processes N`` as a real process: its log lines as they come,
    and every process it starts."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self.family = CommandLines(process.pid)
        self.family.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)

    def wait_for_line(self, text: str, timeout: float) -> str:
        """The first log line holding ``text``, read as the supervisor writes it."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for a log line with {text!r}; "
                    f"seen: {self.log}"
                ) from None
            self.log.append(line)
            if text in line:
                return line

    def alive(self) -> list[str]:
        """The command lines of every process it started that still runs."""
        return [line for pid, line in sorted(self.family.seen.items()) if _running(pid)]


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@contextmanager
def supervisor(url: str, *options: str) -> Iterator[Supervisor]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPLOCK_")}
    command = [sys.executable, "-m", "skiplock", "--database-url", url, "worker", WORKER_APP]
    command += ["--queues", "crash", "--poll-interval", "0.1", *options]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watched = Supervisor(process)
    try:
        yield watched
    finally:
        # Whatever the test saw, leave no process of ours behind.
        if process.poll() is None:
            process.kill()
            process.wait(30)
        watched.family.stop()
        for pid in watched.family.seen:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def worker_pids(conn: psycopg.Connection[Any]) -> list[int]:
    return [int(pid) for (pid,) in conn.execute("SELECT pid FROM skiplock.workers ORDER BY pid")]


@pytest.mark.timeout(120)
def test_a_stop_right_after_a_child_died_ends_the_supervisor_and_every_child(
    app: skiplock.App, autocommit: psycopg.Connection[Any]
) -> None:
    """SIGTERM while the supervisor waits to replace a SIGKILLed child: no replacement
    is left running unsignalled, and the supervisor exits."""
    with supervisor(app.database_url, "--processes", "2") as fleet:
        wait_until(lambda: len(worker_pids(autocommit)) == 2, 60, "two worker processes")
        victim = worker_pids(autocommit)[0]

        os.kill(victim, signal.SIGKILL)
        fleet.wait_for_line(f"worker process {victim} exited", timeout=30)
        fleet.process.send_signal(signal.SIGTERM)

        try:
            code = fleet.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        assert (code, fleet.alive()) == (0, [])


def _history(conn: psycopg.Connection[Any], days_ago: int) -> int:
    """A completed job in history, finished ``days_ago`` days ago (the default
    partition: partitions exist from today on)."""
    row = conn.execute(
        "INSERT INTO skiplock.job_history (id, queue, task, args, state, priority, attempts, "
        "max_attempts, errors, created_at, attempted_at, finished_at) "
        "SELECT nextval(pg_get_serial_sequence('skiplock.jobs', 'id')), 'crash', 'noop', "
        "'{}', 'completed', 0, 1, 3, '[]', f, f, f "
        "FROM (SELECT now() - %s * interval '1 day' AS f) AS finished RETURNING id",
        (days_ago,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _in_history(conn: psycopg.Connection[Any], job_id: int) -> bool:
    return (
        conn.execute("SELECT 1 FROM skiplock.job_history WHERE id = %s", (job_id,)).fetchone()
        is not None
    )


def _leader_pid(conn: psycopg.Connection[Any]) -> int | None:
    row = conn.execute(
        "SELECT w.pid FROM skiplock.leader l JOIN skiplock.workers w ON w.id = l.worker_id "
        "WHERE l.name = 'maintenance' AND l.expires_at > now()"
    ).fetchone()
    return None if row is None else int(row[0])


@pytest.mark.timeout(180)
def test_worker_processes_keep_history_for_the_retention_given(
    app: skiplock.App, autocommit: psycopg.Connection[Any]
) -> None:
    """With --history-retention-days 30, whichever child leads prunes history older than
    30 days and keeps a job finished 10 days ago (the default, 7, would drop it): the
    first leader, and the one elected after it is killed."""
    kept = _history(autocommit, 10)
    expired = _history(autocommit, 40)
    with supervisor(app.database_url, "--processes", "2", "--history-retention-days", "30"):
        wait_until(lambda: not _in_history(autocommit, expired), 60, "the first leader's pruning")
        assert _in_history(autocommit, kept)
        first = _leader_pid(autocommit)
        assert first is not None

        expired = _history(autocommit, 40)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: _leader_pid(autocommit) not in (None, first), 60, "another leader")
        wait_until(lambda: not _in_history(autocommit, expired), 60, "the next leader's pruning")
        assert _in_history(autocommit, kept)
