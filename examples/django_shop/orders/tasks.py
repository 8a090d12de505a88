"""The receipt, sent by a worker (`python manage.py skiplock_worker`) once the order has
committed."""

import importlib.util

from django.core.mail import send_mail
from django.utils import timezone

from orders.models import Order

if importlib.util.find_spec("django.tasks"):
    from django.tasks import task
else:  # Django 5.2 with the django-tasks backport
    from django_tasks import task


@task(queue_name="emails")
def send_receipt(order_id: int) -> dict[str, object]:
    order = Order.objects.get(id=order_id)
    send_mail(
        f"Your order {order.id}",
        f"Thank you! We received {order.total_cents / 100:.2f} EUR.",
        None,
        [order.email],
    )
    # Safe to run twice (delivery is at least once): only the first sending is recorded.
    Order.objects.filter(id=order.id, receipt_sent_at=None).update(receipt_sent_at=timezone.now())
    return {"order": order.id, "to": order.email}
