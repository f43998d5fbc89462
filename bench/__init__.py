"""Benchmarks for celery_etcdlock, run against real local etcd and Redis servers.

    python -m bench.bench_locks            # locks, RW lock, election, side by side with peers (bench/locks/)
    python -m bench.bench_tasks            # a singleton task run through a real prefork worker
    python -m bench.bench_transport        # client CPU per etcd request: our HTTP client against urllib3
    python -m bench.bench_beat             # LeaderScheduler fail-over and idle-follower load
    python -m bench.bench_scale            # capacity at scale: the fleet, its locks, runs and beats (bench/scale/)

bench_locks, bench_tasks and bench_beat take --quick for a smoke run. See bench/README.md for
what is measured and how.
"""
