"""examples/fastapi_orders: its own tests (the pytest plugin, httpx, a real worker
process) pass, and the README's command serves orders and fulfils them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_orders"


def example_environment(**env: str) -> dict[str, str]:
    outside = {key: value for key, value in os.environ.items() if not key.startswith("SKIPLOCK_")}
    return {**outside, **env, "PYTHONDONTWRITEBYTECODE": "1"}


def test_the_examples_own_tests_pass(database_url: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=EXAMPLE,
        env=example_environment(SKIPLOCK_TEST_DATABASE_URL=database_url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "6 passed" in ran.stdout


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_python_dash_m_orders_serves_and_fulfils(
    database_url: str, scratch_schema: str, tmp_path: Path
) -> None:
    port = free_port()
    log = (tmp_path / "orders.log").open("w")
    service = subprocess.Popen(
        [sys.executable, "-m", "orders"],
        cwd=EXAMPLE,
        env=example_environment(
            SKIPLOCK_DATABASE_URL=database_url, SKIPLOCK_SCHEMA=scratch_schema, PORT=str(port)
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                assert service.poll() is None, (tmp_path / "orders.log").read_text()
                try:
                    placed = client.post("/orders", json={"item": "book", "quantity": 2})
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the service did not start in 60 s"
                    time.sleep(0.1)
            assert placed.status_code == 201, placed.text
            order = placed.json()
            while (job := client.get(f"/orders/{order['id']}").json()["job"])["state"] != (
                "completed"
            ):
                assert time.monotonic() < deadline, f"not fulfilled in time: {job}"
                time.sleep(0.1)
        assert job["result"]["shipped"] == "2 x book"
    finally:
        service.send_signal(signal.SIGINT)  # Ctrl-C: the API stops, then the worker
        returncode = service.wait(timeout=60)
        log.close()
    output = (tmp_path / "orders.log").read_text()
    assert returncode == 0, output
    assert "Uvicorn running on" in output, output
    assert output.rstrip().endswith("stopped"), output  # the worker's last word
