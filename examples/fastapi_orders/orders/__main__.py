"""``python -m orders``: migrate, then serve the API on http://127.0.0.1:8000 (or $PORT)
with a skiplock worker beside it, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import uvicorn

from orders.tasks import app


def main() -> None:
    url = app.database_url  # SKIPLOCK_DATABASE_URL; "embedded" starts a local server
    app.migrate()
    port = int(os.environ.get("PORT", "8000"))
    order = '{"item": "book", "quantity": 2}'
    print(
        f"orders: try  curl -X POST localhost:{port}/orders -H 'content-type: application/json'"
        f" -d '{order}'  and then  curl localhost:{port}/orders/1",
        flush=True,
    )
    # The worker gets the URL in its environment, never on its command line.
    worker = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "worker", "orders.tasks:app", "--queues", "orders"],
        env={**os.environ, "SKIPLOCK_DATABASE_URL": url},
    )
    try:
        uvicorn.run("orders.api:api", host="127.0.0.1", port=port)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # it finishes the jobs it holds
        worker.wait(timeout=40)


if __name__ == "__main__":
    main()
