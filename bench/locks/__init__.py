"""The lock benchmark, ``python -m bench.bench_locks``, in its parts.

kinds.py        the locks under test (ours, the peers, the raw floors), as a worker process uses them
harness.py      settings, servers, the worker pool, server counters, timed multi-process runs
uncontended.py  acquire + release latency of a free lock
contention.py   N processes taking turns on one lock: handoffs/s, fairness, proposals per handoff
killed.py       a holder SIGKILLed: how soon a queued waiter gets the lock
election.py     leader fail-over after resign() and after SIGKILL
rwlock.py       RWLock under a 90/10 read/write mix against Mutex
hold.py         keep-alive traffic of many locks held at once
targets.py      the targets a run is checked against
report.py       the workloads in report order, and the Markdown report
"""
