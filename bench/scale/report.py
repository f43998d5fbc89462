"""The capacity benchmark's report: Markdown tables, the plot, and the figures the model is built from.

text = markdown(results)            # every table; results as bench_scale collects them
plot(results, "docs/capacity-idle.png")
figures = model(results, "cluster")  # requests/s per idle worker, per held lock, per run, per follower, ...
"""

from __future__ import annotations

import math
from typing import Any

from bench.common import fmt, markdown_table


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def model(results: dict[str, Any], target: str) -> dict[str, float]:
    """The model's unit costs on ``target``, from its rows (each an average over the cells it applies to)."""
    results = {key: [r for r in rows if r.get("target") == target] if isinstance(rows, list) and key != "targets"
               else rows for key, rows in results.items()}  # fmt: skip
    idle = [r for r in results.get("idle", []) if r["kind"] == "ours"]
    ttl = results["settings"]["ttl"]
    at_ttl = [r for r in idle if r["ttl"] == ttl]
    figures: dict[str, float] = {"ttl": ttl}
    figures["idle_worker_requests_per_s"] = _mean([r["requests_per_s"] / r["n"] for r in at_ttl if r["k"] == 0])
    holding = [r for r in at_ttl if r["k"] > 0]
    figures["holding_worker_requests_per_s"] = _mean([r["requests_per_s"] / r["n"] for r in holding])
    figures["holding_worker_proposals_per_s"] = _mean([r["proposals_per_s"] / r["n"] for r in holding])
    biggest = max((r["n"] for r in holding), default=0)
    ks = sorted((r["k"], r["requests_per_s"]) for r in holding if r["n"] == biggest)
    if len(ks) >= 2 and ks[-1][0] != ks[0][0]:
        figures["per_extra_lock_requests_per_s"] = (ks[-1][1] - ks[0][1]) / (ks[-1][0] - ks[0][0]) / biggest
    cpu = [(r["etcd_cpu_per_s"], r["requests_per_s"]) for r in holding if r["n"] == biggest]
    if cpu:
        figures["etcd_cpu_ms_per_idle_request"] = 1000 * _mean([c / q for c, q in cpu if q])
    figures["client_cpu_ms_per_s_per_holding_worker"] = 1000 * _mean([r["client_cpu_per_client"] for r in holding])
    for other in results["settings"].get("other_ttls", []):
        rows = [r for r in idle if r["ttl"] == other and r["k"] > 0]
        if rows:
            figures[f"holding_worker_requests_per_s_ttl{other:g}"] = _mean([r["requests_per_s"] / r["n"] for r in rows])
    busy = [r for r in results.get("busy", []) if r["kind"] == "ours"]
    if busy:
        best = max(busy, key=lambda r: r["runs_per_s"])
        figures["singleton_requests_per_run"] = _mean([r["requests_per_run"] for r in busy])
        figures["singleton_proposals_per_run"] = _mean([r["proposals_per_run"] for r in busy])
        figures["singleton_etcd_cpu_ms_per_run"] = best["etcd_cpu_ms_per_run"]
        figures["singleton_runs_per_s_max"] = best["runs_per_s"]
        figures["singleton_p50_ms_at_max"] = best["p50_ms"]
        figures["singleton_p99_ms_at_max"] = best["p99_ms"]
    floor = [r for r in results.get("busy", []) if r["kind"] == "floor"]
    if floor:
        figures["floor_runs_per_s_max"] = max(r["runs_per_s"] for r in floor)
    beat = results.get("beats", [])
    if beat:
        figures["beat_follower_requests_per_s"] = _mean([r["requests_per_s_per_follower"] for r in beat])
        figures["beat_failover_s_max"] = max(r["failover_s"] for r in beat)
    return figures


def handoff_requests(row: dict[str, Any]) -> float:
    """A hot-key row's requests per handoff without the waiting clients' renewals (3 per keep-alive)."""
    renewals = 3 * row["by_method"].get("LeaseKeepAlive", 0.0) * row["seconds"]
    return (row["requests"] - renewals) / max(1, row["handoffs"])


def _per(value: float, n: float) -> float:
    return value / n if n else math.nan


def markdown(results: dict[str, Any]) -> str:
    parts: list[str] = []
    for target in results["targets"]:
        idle = [r for r in results.get("idle", []) if r["target"] == target]
        if idle:
            parts.append(f"#### Idle fleet, {target}\n")
            parts.append(markdown_table(
                ["lock", "ttl", "N clients", "K locks each", "requests/s", "per client", "proposals/s", "leases",
                 "keys", "watchers", "etcd CPU s/s", "etcd RSS MB", "client CPU ms/s each", "held", "lost", "load"],
                [[r["kind"], r["ttl"], r["n"], r["k"], r["requests_per_s"], _per(r["requests_per_s"], r["n"]),
                  r["proposals_per_s"], r["leases"], int(r["keys"]), int(r["watchers"]), r["etcd_cpu_per_s"],
                  r["etcd_rss_mb"], 1000 * r["client_cpu_per_client"], r["held"], r["lost"], r["load"]]
                 for r in idle]))  # fmt: skip
        busy = [r for r in results.get("busy", []) if r["target"] == target]
        if busy:
            parts.append(f"\n#### Busy fleet, {target}: singleton runs on distinct keys, closed loops\n")
            parts.append(markdown_table(
                ["path", "loops", "runs/s", "p50 ms", "p99 ms", "requests/run", "proposals/run", "etcd CPU ms/run",
                 "etcd CPU s/s", "client CPU s/s", "errors", "load"],
                [[r["kind"], r["threads"], r["runs_per_s"], r["p50_ms"], r["p99_ms"], r["requests_per_run"],
                  r["proposals_per_run"], r["etcd_cpu_ms_per_run"], r["etcd_cpu_per_s"], r["client_cpu_per_s"],
                  r["errors"], r["load"]] for r in busy]))  # fmt: skip
        hot = [r for r in results.get("hot", []) if r["target"] == target]
        if hot:
            parts.append(f"\n#### Hot keys, {target}: every waiter queued, then the holders release\n")
            parts.append(markdown_table(
                ["keys", "waiters each", "handoffs", "handoffs/s", "watchers queued", "requests/handoff",
                 "of which the handoff's", "proposals/handoff", "watch events/handoff", "failed", "load"],
                [[r["names"], r["waiters_per_name"], r["handoffs"], r["handoffs_per_s"], int(r["watchers_before"]),
                  r["requests_per_handoff"], handoff_requests(r), r["proposals_per_handoff"], r["events_per_handoff"],
                  r["failed"], r["load"]] for r in hot]))  # fmt: skip
        beat = [r for r in results.get("beats", []) if r["target"] == target]
        if beat:
            parts.append(f"\n#### Beats, {target}: LeaderScheduler followers, then the leader SIGKILLed\n")
            parts.append(markdown_table(
                ["followers", "beat ttl", "requests/s (all)", "leader alone", "per follower",
                 "proposals/s per follower", "client CPU ms/s per follower", "SIGKILL fail-over s", "load"],
                [[r["followers"], r["ttl"], r["requests_per_s"], r["leader_alone_requests_per_s"],
                  r["requests_per_s_per_follower"], r["proposals_per_s_per_follower"],
                  1000 * r["client_cpu_per_follower"], r["failover_s"], r["load"]] for r in beat]))  # fmt: skip
        read = [r for r in results.get("renewal", []) if r["target"] == target]
        if read:
            parts.append(f"\n#### What a renewal reads, {target}: the key listing of one lease\n")
            parts.append(markdown_table(
                ["keys on the lease", "bytes", "bytes/key", "listing ms"],
                [[r["keys"], r["bytes"], r["bytes_per_key"], r["listing_ms"]] for r in read]))  # fmt: skip
        parts.append("")
    for target in results["targets"]:
        figures = model(results, target)
        parts.append(f"\n#### The model's unit costs, {target} (derived from the rows above)\n")
        parts.append(markdown_table(["figure", "value"], [[k, fmt(v, 3)] for k, v in figures.items()]))
    return "\n".join(parts) + "\n"


def plot(results: dict[str, Any], path: str) -> bool:
    """etcd requests/s against N, one line per K (and target); False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ttl = results["settings"]["ttl"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles = {"cluster": "-", "single": "--"}
    for target in results["targets"]:
        rows = [r for r in results.get("idle", []) if r["target"] == target and r["kind"] == "ours" and r["ttl"] == ttl]
        for k in sorted({r["k"] for r in rows}):
            points = sorted((r["n"], max(r["requests_per_s"], 0.01)) for r in rows if r["k"] == k)
            axes.plot([p[0] for p in points], [p[1] for p in points], styles.get(target, "-"), marker="o",
                      label=f"K={k} locks each, {target}")  # fmt: skip
        tooz = [r for r in results.get("idle", []) if r["target"] == target and r["kind"] == "tooz"]
        for k in sorted({r["k"] for r in tooz}):
            points = sorted((r["n"], r["requests_per_s"]) for r in tooz if r["k"] == k)
            axes.plot([p[0] for p in points], [p[1] for p in points], ":", marker="x", label=f"tooz K={k}, {target}")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("N clients (worker processes)")
    axes.set_ylabel("etcd requests/s (all members)")
    axes.set_title(f"Idle fleet: etcd requests/s against N (ttl {ttl:g}; K=0 is 0, drawn at 0.01)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
