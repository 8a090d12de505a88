from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies = []  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("email", models.EmailField(max_length=254)),
                ("total_cents", models.PositiveIntegerField()),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("receipt_task_id", models.CharField(blank=True, max_length=32)),
                ("receipt_sent_at", models.DateTimeField(blank=True, null=True)),
            ],
        ),
    ]
