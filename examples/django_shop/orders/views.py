"""POST /orders places an order; GET /orders/<id> reports it and its receipt task."""

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from orders.models import Order
from orders.services import PaymentDeclinedError, place_order
from orders.tasks import send_receipt


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    try:
        order = place_order(
            body["email"], int(body["total_cents"]), card_ok=body.get("card_ok", True)
        )
    except PaymentDeclinedError as exc:
        return JsonResponse({"error": str(exc)}, status=402)
    return JsonResponse({"order": order.id, "receipt_task": order.receipt_task_id}, status=201)


@require_GET
def order_status(request: HttpRequest, order_id: int) -> JsonResponse:
    order = Order.objects.filter(id=order_id).first()
    if order is None:  # never placed, or its transaction rolled back
        return JsonResponse({"error": f"no order {order_id}"}, status=404)
    receipt = send_receipt.get_result(order.receipt_task_id)
    return JsonResponse(
        {
            "order": order.id,
            "receipt_sent_at": order.receipt_sent_at,
            "receipt_task": {
                "id": receipt.id,
                "status": receipt.status,
                "attempts": receipt.attempts,
            },
        }
    )
