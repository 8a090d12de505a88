"""Placing an order: the order row and its receipt job in one transaction."""

from django.db import transaction

from orders.models import Order
from orders.tasks import send_receipt


class PaymentDeclinedError(Exception):
    pass


def place_order(email: str, total_cents: int, *, card_ok: bool = True) -> Order:
    """Save the order and enqueue its receipt. If anything in the block raises, neither
    the order nor the receipt job exists: no receipt for an order that was never saved."""
    with transaction.atomic():
        order = Order.objects.create(email=email, total_cents=total_cents)
        result = send_receipt.enqueue(order.id)  # an INSERT in this same transaction
        order.receipt_task_id = result.id
        order.save(update_fields=["receipt_task_id"])
        if not card_ok:
            raise PaymentDeclinedError(f"card declined for order {order.id}")
    return order
