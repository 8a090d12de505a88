from django.db import models


class Ran(models.Model):
    """One row per task run that asked for it: the order tasks ran in, and what they saw."""

    label = models.CharField(max_length=100)
    attempt = models.IntegerField(default=0)
