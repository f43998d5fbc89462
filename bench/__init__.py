"""Benchmarks for celery_etcdlock, run against real local etcd and Redis servers.

    python -m bench.bench_locks            # locks, RW lock, election, side by side with peers
    python -m bench.bench_locks --quick    # a one-minute smoke run

See bench/README.md for what is measured and how.
"""
