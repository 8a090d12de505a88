"""The service as it runs in production: uvicorn in a process of its own, called over
HTTP with httpx, and a real worker process; both on the database and throwaway schema
of skiplock's pytest fixtures (see pytest.ini)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import skiplock

EXAMPLE = Path(__file__).resolve().parents[1]


def environment(app: skiplock.App) -> dict[str, str]:
    """What the service's processes need to find the fixtures' database and schema."""
    return {**os.environ, "SKIPLOCK_DATABASE_URL": app.database_url, "SKIPLOCK_SCHEMA": app.schema}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def service(skiplock_app: skiplock.App) -> Iterator[str]:
    """``uvicorn orders.api:api`` on a free local port, for the whole session: its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "orders.api:api", "--port", str(port)],
        cwd=EXAMPLE,
        env=environment(skiplock_app),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert process.poll() is None, "the service exited"
        try:
            httpx.get(f"{url}/docs", timeout=1).raise_for_status()
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the service did not start in 30 s"
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def client(service: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service, timeout=10) as opened:
        yield opened


@pytest.fixture
def worker(skiplock_app: skiplock.App) -> Iterator[subprocess.Popen[bytes]]:
    """``skiplock worker orders.tasks:app``, stopped (SIGTERM) after the test."""
    process = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "worker", "orders.tasks:app", "--queues", "orders"],
        cwd=EXAMPLE,
        env=environment(skiplock_app),
    )
    yield process
    process.terminate()
    assert process.wait(timeout=30) == 0
