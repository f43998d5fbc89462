"""``python -m django shop_migrate``: migrate, then make the example's schedule (idempotent)."""

import json
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand

HEARTBEAT = "heartbeat"  # the PeriodicTask's name
EVERY = 5  # seconds


class Command(BaseCommand):
    help = "Migrate the database, then create the example's PeriodicTask (djangoshop.heartbeat every 5 s)."

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", interactive=False, verbosity=options["verbosity"])
        # imported after the migration: django-celery-beat's tables exist now
        from django_celery_beat.models import IntervalSchedule, PeriodicTask

        interval, _ = IntervalSchedule.objects.get_or_create(every=EVERY, period=IntervalSchedule.SECONDS)
        _, created = PeriodicTask.objects.update_or_create(
            name=HEARTBEAT,
            defaults={"task": "djangoshop.heartbeat", "interval": interval, "kwargs": json.dumps({}), "enabled": True},
        )
        self.stdout.write(f"{'created' if created else 'kept'} PeriodicTask {HEARTBEAT!r}: every {EVERY} s")
