"""What ``leader_only`` knows of the stores of the schedulers it wraps: small hook classes.

    hooks_for(DatabaseScheduler)    # (DatabaseStoreHooks,): put before LeaderMixin in the bases

A scheduler with a store keeps entries and their last runs somewhere of its own
(django-celery-beat: the database). After another leader ran the schedule, a new
leader re-reads it (``reload_schedule``); an entry whose stored last run is older
than the run recorded in etcd takes the recorded one, and the store learns it at
the next ``sync()`` (``adopt_run``); a deposed leader drops what it had not
written yet (``forget_unsynced``). Nothing here imports the scheduler it serves.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any


class DatabaseStoreHooks:
    """LeaderMixin's hooks for django-celery-beat's ``DatabaseScheduler`` and its subclasses."""

    _dirty: set[str]
    _initial_read: bool
    schedule: Any

    def reload_schedule(self) -> None:
        # another leader ran the schedule meanwhile: every entry as the database has it now
        self._dirty.clear()
        self._initial_read = True
        self.schedule  # noqa: B018 (the property reads the database)

    def adopt_run(self, entry: Any, last_run_at: datetime, count: int) -> None:
        entry.last_run_at, entry.total_run_count = last_run_at, count
        model = getattr(entry, "model", None)
        if model is not None:  # the database learns it at the next sync()
            model.last_run_at, model.total_run_count, model.no_changes = last_run_at, count, True
            self._dirty.add(entry.name)

    def forget_unsynced(self) -> None:
        self._dirty.clear()


#: qualified class name -> its hooks; leader_only looks each class of the wrapped one's MRO up here
HOOKS: dict[str, tuple[type[Any], ...]] = {
    "django_celery_beat.schedulers.DatabaseScheduler": (DatabaseStoreHooks,),
}


def hooks_for(scheduler_class: type[Any]) -> tuple[type[Any], ...]:
    for klass in scheduler_class.__mro__:
        hooks = HOOKS.get(f"{klass.__module__}.{klass.__qualname__}")
        if hooks is not None:
            return hooks
    return ()
