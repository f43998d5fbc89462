"""Capacity at scale: what one etcd serves as the fleet, its locks, its runs and its beats grow (issue 26).

    python -m bench.bench_scale                      # both targets, every workload: about 12-15 minutes
    python -m bench.bench_scale --quick              # a smoke run: about 3-4 minutes
    python -m bench.bench_scale --targets single --only idle --json out.json --markdown out.md
    python -m bench.bench_scale --quick --only idle --targets single --cells 1    # the smallest cell

Targets: a real 3-member etcd cluster on loopback ("cluster") and a single member ("single"), each started
fresh on free ports; ``--etcd`` picks the release line (3.5, the default; 3.6 or 3.7: tests/support builds
them). Workloads (``--only``, comma-separated):

- idle: N clients (each its own connect(): session, lease, renewer), each holding K locks, for
  N = 10, 100, 1000 and K = 0, 1, 10, 100 at ttl 10, and N=100 K=1 at ttl 30; the raw floor (a lease
  per client, one keep-alive every ttl/3) and tooz's etcd3gw locks on a few cells;
- busy: closed loops of singleton runs through SingletonTask's lock path (``task(i)``, no broker) on
  distinct keys, 1 to 48 loops, beside the raw floor of the same two writes;
- hot: 3 hot locks with 100 waiters each (a client each), all queued, then released: a release must
  wake one waiter (watch events per handoff ~1, not ~100);
- beats: 2, 10, 50 LeaderScheduler followers of one leader: the cost of each; then the leader
  SIGKILLed: the take-over time;
- renewal: what a v3 renewal reads (its lease's key listing) with 100, 10,000 and 100,000 keys on one lease.

Everything runs on the one machine, clients and etcd alike: say where a figure is bound by the
harness (docs/capacity.md does). The load average is printed with every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Pool
from bench.scale import report, workloads
from bench.scale.target import VERSION, Target, machine_load

WORKLOADS = ("idle", "busy", "hot", "beats", "renewal")
SHARE = {"cluster": 2.0, "single": 1.0}  # of the time budget: the cluster runs more cells
ROOT = Path(__file__).resolve().parent.parent


def for_target(settings: workloads.Settings, kind: str, quick: bool) -> workloads.Settings:
    """The single member repeats the cluster's idle cells of 100 and 1,000 clients up to 10,000 locks in all,
    without beats and tooz: the flatness in K, the beats and the peer are shown on the cluster, and the whole
    run must stay within 15 minutes."""
    if kind != "single" or quick:
        return settings
    return dataclasses.replace(
        settings, fleet_sizes=[100, 1000], big_cells=False, beat_followers=[], tooz_cells=[], floor_cells=[(100, 10)]
    )


def steps(
    target: Target, pool: Pool, settings: workloads.Settings, only: list[str], smoke: bool
) -> list[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    """The workloads in the order they run: what the model rests on first, the comparisons last
    (a run out of time skips what is left)."""
    chosen: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = []
    if "renewal" in only:
        chosen.append(("renewal", lambda: workloads.renewal_read(target, settings.renewal_sizes)))
    if "idle" in only:
        chosen.append(("idle", lambda: workloads.idle_fleet(target, pool, settings, "ours")))
    if "busy" in only:
        chosen += [("busy", lambda: workloads.busy_fleet(target, pool, settings, "ours")),
                   ("busy", lambda: workloads.busy_fleet(target, pool, settings, "floor"))]  # fmt: skip
    if "hot" in only:
        chosen.append(("hot", lambda: workloads.hot_keys(target, pool, settings)))
    if "beats" in only and settings.beat_followers:
        chosen.append(("beats", lambda: workloads.beats(target, pool, settings)))
    if "idle" in only and not smoke:
        chosen += [("idle", lambda: workloads.idle_fleet(target, pool, settings, "floor"))]
        if settings.tooz_cells:
            chosen.append(("idle", lambda: workloads.idle_fleet(target, pool, settings, "tooz")))
        if settings.big_cells:
            big = dataclasses.replace(settings, big=True, other_ttls=[])
            chosen.append(("idle", lambda: workloads.idle_fleet(target, pool, big, "ours")))
    return chosen


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = workloads.Settings.make(args.quick)
    if args.cells:  # the smallest cells only: the harness's own test
        settings.fleet_sizes = settings.fleet_sizes[: args.cells]
        settings.locks_per_client = settings.locks_per_client[: args.cells + 1]
        settings.other_ttls = []
        settings.window = min(settings.window, 2.0)
    only = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = sorted(set(only) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"bench_scale: unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    targets = args.targets.split(",")
    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "targets": targets,
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "load_start": machine_load(),
            "etcd": args.etcd,
        },
    }
    started = time.monotonic()
    shares = [SHARE.get(kind, 1.0) for kind in targets]
    pool = Pool(preload=["bench.scale.fleet"])
    try:
        for index, kind in enumerate(targets):
            settings = for_target(settings, kind, args.quick)
            # each target gets its share of the budget, so that the first cannot crowd out the second
            settings.deadline = started + args.budget * sum(shares[: index + 1]) / sum(shares)
            with Target(kind, args.etcd) as target:
                print(f"{kind}: etcd {args.etcd} on {', '.join(target.endpoints)} (load {machine_load()})", flush=True)
                for step, what in steps(target, pool, settings, only, bool(args.cells)):
                    if time.monotonic() > settings.deadline:
                        print(f"  {step}: skipped, the run's time budget (--budget) is spent", flush=True)
                        continue
                    results.setdefault(step, []).extend(what())
    finally:
        pool.close()
    results["machine"].update(load_end=machine_load(), seconds=time.monotonic() - started)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: smaller cells, shorter windows")
    parser.add_argument("--targets", default="cluster,single", help="cluster, single or both (comma-separated)")
    parser.add_argument("--only", default="", help=f"a subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--cells", type=int, default=0, help="idle: only the first CELLS fleet sizes (a smoke test)")
    parser.add_argument("--etcd", default=VERSION, help="the etcd release line: 3.5 (default), 3.6 or 3.7")
    parser.add_argument("--budget", type=float, default=870.0, help="seconds; cells not started by then are skipped")
    parser.add_argument("--json", type=Path, help="write every raw number here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--plot", type=Path, help="write the idle fleet's plot (PNG) here")
    args = parser.parse_args(argv)
    results = run(args)
    text = report.markdown(results)
    m = results["machine"]
    header = (
        f"bench_scale{' --quick' if args.quick else ''}: {m['seconds']:.0f} s on {m['cores']} cores, "
        f"Python {m['python']}, load average {m['load_start']} at the start, {m['load_end']} at the end\n"
    )
    print("\n" + header + "\n" + text)
    if args.markdown:
        args.markdown.write_text(header + "\n" + text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.plot and "idle" in results and not report.plot(results, str(args.plot)):
        print("bench_scale: matplotlib is not installed: no plot", file=sys.stderr)
    lost = sum(r.get("lost", 0) for r in results.get("idle", []))
    if lost:
        print(f"bench_scale: {lost} locks were lost during the idle fleet", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
