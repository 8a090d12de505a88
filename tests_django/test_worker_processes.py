"""``manage.py skiplock_worker --processes N``, all real processes: a stop signal ends the
supervisor and every worker process, even while a dead one is being replaced, and every
worker process runs with the options given (its history retention here)."""

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
from django.conf import settings
from django.db import connection

from tests_django.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rpartition(")")[2].split()[1]) == pid:
            found.add(int(entry.name))
    return found


class Fleet:
    """The supervisor's log lines as they come, and every child it started."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: set[int] = set()
        self._stop = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.seen |= _children(self.process.pid)

    def wait_for_line(self, text: str, timeout: float) -> None:
        log = []
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no log line with {text!r} in {timeout}s: {log}") from None
            log.append(line)
            if text in line:
                return

    def alive(self) -> list[int]:
        return sorted(pid for pid in self.seen if _running(pid))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._stop.set()
        for pid in self.alive():
            os.kill(pid, signal.SIGKILL)


# A program of the user's that runs the command with call_command (it has no command line
# of the command's own to repeat, and must not itself be run again).
CALL_COMMAND = (
    "import sys, django; django.setup(); from django.core.management import call_command; "
    "call_command('skiplock_worker', *sys.argv[1:])"
)


@contextmanager
def fleet(*options: str, call_command: bool = False) -> Iterator[Fleet]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests_django.settings",
        "SKIPLOCK_TEST_DSN": settings.SERVER,
        "SKIPLOCK_DJANGO_DATABASE": connection.settings_dict["NAME"],
        "PYTHONPATH": str(ROOT),
    }
    command = [sys.executable, *(("-c", CALL_COMMAND) if call_command else ("-m", "django"))]
    command += [] if call_command else ["skiplock_worker"]
    command += ["--poll-interval", "0.1"]
    process = subprocess.Popen(
        [*command, *options],
        env=env,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watched = Fleet(process)
    try:
        yield watched
    finally:
        watched.close()


def worker_pids(conn: psycopg.Connection[Any]) -> list[int]:
    return [int(pid) for (pid,) in conn.execute("SELECT pid FROM skiplock.workers ORDER BY pid")]


@pytest.mark.timeout(120)
def test_a_stop_right_after_a_child_died_ends_the_supervisor_and_every_child(
    database_url: str,
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn, fleet("--processes", "2") as f:
        wait_until(lambda: len(worker_pids(conn)) == 2, 60, "two worker processes")
        victim = worker_pids(conn)[0]

        os.kill(victim, signal.SIGKILL)
        f.wait_for_line(f"worker process {victim} exited", timeout=30)
        f.process.send_signal(signal.SIGTERM)

        try:
            code = f.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        assert (code, f.alive()) == (0, [])


def _history(conn: psycopg.Connection[Any], days_ago: int) -> int:
    """A completed job finished ``days_ago`` days ago (in the default partition)."""
    row = conn.execute(
        "INSERT INTO skiplock.job_history (id, queue, task, args, state, priority, attempts, "
        "max_attempts, errors, created_at, attempted_at, finished_at) "
        "SELECT nextval(pg_get_serial_sequence('skiplock.jobs', 'id')), 'default', 'noop', "
        "'{}', 'completed', 0, 1, 3, '[]', f, f, f "
        "FROM (SELECT now() - %s * interval '1 day' AS f) AS finished RETURNING id",
        (days_ago,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _in_history(conn: psycopg.Connection[Any], job_id: int) -> bool:
    found = conn.execute("SELECT 1 FROM skiplock.job_history WHERE id = %s", (job_id,))
    return found.fetchone() is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call_command", [False, True], ids=["manage.py", "call_command"])
def test_worker_processes_keep_history_for_the_retention_given(
    database_url: str, call_command: bool
) -> None:
    """Whichever worker process leads prunes with the retention given: a job finished 10
    days ago stays under 30 days (the default, 7, would drop it), one of 40 goes. Run by
    call_command too, whose options are not on any command line."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        kept, expired = _history(conn, 10), _history(conn, 40)
        options = ("--processes", "2", "--history-retention-days", "30")
        with fleet(*options, call_command=call_command):
            wait_until(lambda: not _in_history(conn, expired), 60, "the leader's pruning")
            assert _in_history(conn, kept)
