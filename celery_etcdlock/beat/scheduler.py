"""``LeaderScheduler``: celery beat on every host, only the elected leader sends.

    celery -A proj beat -S celery_etcdlock.beat:LeaderScheduler
    # or: app.conf.beat_scheduler = "celery_etcdlock.beat:LeaderScheduler"

Every beat process campaigns in the election ``beat/<name>`` (``name`` is the
``etcdlock_beat_name`` setting, else the app's main module name) with the
identity ``host:pid`` and the TTL ``etcdlock_beat_ttl``. The leader sends the
app's ``beat_schedule`` (interval, crontab and solar entries, with their args,
kwargs and options); the others stand by: they neither read nor write the
schedule, and make no etcd request of their own (the election watches the
leader's entry and wakes them when they are elected).

The schedule's state, each entry's last run time and run count, is one JSON
document in etcd (``DocumentStore(client, "beat-state")``, named like the
election), so a new leader continues where the old one stopped.

What it guarantees (no run sent twice, a missed run sent once, at most
once, fail closed), and why, is in docs/beat.md.

It is ``LeaderMixin`` (beat/leader.py) over celery's plain ``Scheduler``:
beats of any kind made leader-only with ``leader_only()`` share its election
when they share ``etcdlock_beat_name``. Losing leadership is not fatal: the scheduler stops sending at once, logs it
and campaigns again. ``close()`` (celery beat calls it on SIGTERM and Ctrl-C)
resigns, so a follower takes over at once.

Static schedule changes take effect when a leader takes over with the new
configuration: it keeps the state of entries it knows by name, starts new ones
as if beat had just started, and drops the state of removed entries. Only the
leader ever writes the document.
"""

from __future__ import annotations

from celery.beat import Scheduler

from .leader import FOLLOWER_WAKEUP, RETRY_AFTER, TAKE_OVER_ATTEMPTS, LeaderMixin, beat_name
from .runs import STATE_FORMAT, STATE_KIND, decode_state, encode_time


class LeaderScheduler(LeaderMixin, Scheduler):
    """A celery beat scheduler that sends only while elected leader; its schedule is ``beat_schedule``.

    ``etcd_client`` (optional) replaces the client the app's settings name;
    ``identity`` (optional) replaces ``host:pid`` in the election.
    """

    #: the schedule state is written with every run, so there is nothing to sync
    sync_every = float("inf")
    #: the schedule is the configuration: every process reads it at its start, nothing is written
    sets_up_when_elected = False
    #: no store of its own: the runs recorded in etcd are the whole state
    store_keeps_runs = False
    #: LeaderSchedulerEntry: entries saved at run time are sent too (beat/entries.py, beat/runtime.py)
    runtime_entries = True

    def sync(self) -> None:
        pass  # every run is already in etcd


__all__ = [
    "FOLLOWER_WAKEUP",
    "RETRY_AFTER",
    "STATE_FORMAT",
    "STATE_KIND",
    "TAKE_OVER_ATTEMPTS",
    "LeaderScheduler",
    "beat_name",
    "decode_state",
    "encode_time",
]
