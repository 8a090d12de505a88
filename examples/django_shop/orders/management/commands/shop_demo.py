"""The shop in one command: an order that rolls back, one that commits, and a worker
process that sends the committed order's receipt."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from django.core.management.base import BaseCommand

from orders.models import Order
from orders.services import PaymentDeclinedError, place_order
from orders.tasks import send_receipt

try:
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # the django-tasks backport
    from django_tasks.exceptions import TaskResultDoesNotExist

MANAGE = Path(__file__).resolve().parents[3] / "manage.py"


class Command(BaseCommand):
    help = "Place an order that rolls back and one that commits; a worker sends the receipt."

    def handle(self, *args: object, **options: object) -> None:
        say = self.stdout.write
        say("1. Payment declined: the order and its receipt job roll back together.")
        before = set(Order.objects.values_list("id", flat=True))
        try:
            place_order("ann@example.com", 4200, card_ok=False)
        except PaymentDeclinedError as exc:
            say(f"   place_order raised PaymentDeclinedError: {exc}")
        new_orders = Order.objects.exclude(id__in=before).count()
        say(f"   orders saved: {new_orders}")
        # The rolled-back job took an id from the sequence; it is the one before the next.
        order = place_order("bob@example.com", 1999)
        rolled_back_id = str(int(order.receipt_task_id) - 1)
        try:
            send_receipt.get_result(rolled_back_id)
            say(f"   receipt job {rolled_back_id}: exists (unexpected)")
        except TaskResultDoesNotExist:
            say(f"   receipt job {rolled_back_id}: TaskResultDoesNotExist (never committed)")

        say("2. Payment accepted: the order and its receipt job commit together.")
        result = send_receipt.get_result(order.receipt_task_id)
        say(
            f"   order {order.id} saved for {order.email}; receipt job {result.id}: {result.status}"
        )

        say("3. A worker process (manage.py skiplock_worker --queues emails) sends it.")
        worker = subprocess.Popen(
            [
                sys.executable,
                str(MANAGE),
                "skiplock_worker",
                "--queues",
                "emails",
                "--poll-interval",
                "0.2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not result.is_finished and time.monotonic() < deadline:
                time.sleep(0.1)
                result.refresh()
        finally:
            worker.send_signal(signal.SIGTERM)
            output, _ = worker.communicate(timeout=60)
        for line in output.splitlines():
            if line.startswith(("Subject:", "To:")):
                say(f"   worker printed the mail: {line}")
        order.refresh_from_db()
        say(f"   order {order.id} receipt_sent_at: {order.receipt_sent_at:%Y-%m-%d %H:%M:%S}")
        say("   the receipt job's TaskResult:")
        for field in (
            "id",
            "status",
            "enqueued_at",
            "started_at",
            "finished_at",
            "attempts",
            "worker_ids",
            "args",
            "kwargs",
            "errors",
        ):
            say(f"     {field}: {getattr(result, field)}")
        say(f"     return_value: {result.return_value}")
