"""`manage.py skiplock_worker` as a process of its own runs Django tasks, sync, async and
with their context, stops cleanly on SIGTERM, and runs several processes with
--processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from skiplock.contrib.django.backend import SkiplockBackend
from skiplock.contrib.django.compat import TaskResultStatus
from tests_django.conftest import finished_result, wait_until
from tests_django.taskapp import tasks

ROOT = Path(__file__).resolve().parent.parent

Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start_process(database_url: str) -> Iterator[Start]:
    started: list[subprocess.Popen[str]] = []

    def start(*options: str) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests_django.settings",
            "SKIPLOCK_TEST_DSN": settings.SERVER,
            "SKIPLOCK_DJANGO_DATABASE": connection.settings_dict["NAME"],
            "PYTHONPATH": str(ROOT),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "django", "skiplock_worker", "--poll-interval", "0.1", *options],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    return output


def test_a_worker_process_runs_django_tasks(backend: SkiplockBackend, start_process: Start) -> None:
    process = start_process("--concurrency", "4")
    results = [
        tasks.add.enqueue(1, b=2),
        tasks.async_add.enqueue(3, 4),
        tasks.introspect.enqueue(5),
        tasks.send_email.enqueue("ann@example.com"),
    ]

    done = [finished_result(backend, r.id, timeout=30) for r in results]

    assert [d.status for d in done] == [TaskResultStatus.SUCCESSFUL] * 4
    assert [d.return_value for d in done[:2]] == [3, 7]
    worker_ids = {d.worker_ids[0] for d in done}
    assert len(worker_ids) == 1
    assert done[2].return_value["worker_ids"] == list(worker_ids)
    assert done[3].return_value == {"to": "ann@example.com", "subject": "hello"}
    output = stop(process)
    assert f"worker {worker_ids.pop()} stopped" in output


def test_processes_runs_several_worker_processes(
    backend: SkiplockBackend, start_process: Start
) -> None:
    process = start_process("--processes", "2", "--concurrency", "1", "--prefetch", "0")
    wait_until(
        lambda: (
            backend.connection()
            .cursor()
            .execute("SELECT count(*) FROM skiplock.workers")
            .fetchone()[0]
            == 2
        ),
        30.0,
        "two worker processes to register",
    )
    results = [tasks.add.enqueue(i) for i in range(6)]

    done = [finished_result(backend, r.id, timeout=30) for r in results]

    assert sorted(d.return_value for d in done) == list(range(6))
    stop(process)
