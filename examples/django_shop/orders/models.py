from django.db import models


class Order(models.Model):
    email = models.EmailField()
    total_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    # The receipt task's id (a skiplock job id), and when the receipt went out.
    receipt_task_id = models.CharField(max_length=32, blank=True)
    receipt_sent_at = models.DateTimeField(null=True, blank=True)
