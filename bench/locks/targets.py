"""The targets a full lock benchmark run is held to, checked against its results.

rows = check(results)      # [[target, measured, met], ...] for what the run measured
"""

from __future__ import annotations

from typing import Any

from bench.common import ratio
from bench.locks.kinds import KINDS, OTHER_V3_LINES

# ours / raw floor, median; v3's on every release line (the limit is our client's cost over the floor's)
UNCONTENDED_LIMIT = {"v2": 1.3, "v3": 1.1, **{f"v3-{line}": 1.1 for line in OTHER_V3_LINES}}
# handoffs/s at 32 procs >= factor x peer's raw handoffs/s (issue 12: at least tooz's on etcd 3.4 and 3.5;
# 3.6 and 3.7 are held to 3.4's "at least tooz's", as issue 23 names no figure of its own)
CONTENTION_PEER = {
    "v2": ("etcd.Lock", 1.2),
    "v3": ("tooz-etcd3gw", 2.0),
    **{f"v3-{line}": (f"tooz-etcd3gw-{line}", 1.0) for line in OTHER_V3_LINES},
}


def check(results: dict) -> list[list[Any]]:
    rows: list[list[Any]] = []
    unc, con = results.get("uncontended", {}), results.get("contention", {})
    for api, limit in UNCONTENDED_LIMIT.items():
        ours, floor = unc.get(f"ours-{api}"), unc.get(f"floor-{api}")
        if ours and floor:
            r = ratio(ours["median_ms"], floor["median_ms"])
            rows.append([f"{api} uncontended acquire+release <= {limit}x raw floor (median)", f"{r:.2f}x", r <= limit])
    for api, (peer, factor) in CONTENTION_PEER.items():
        ours = con.get(f"ours-{api}", {})
        big = ours.get("32") or (ours.get(max(ours, key=int)) if ours else None)
        if not big:
            continue
        n = str(big["procs"])
        small = ours.get("2")
        p = big["proposals_per_op"]
        if api == "v2":
            rows.append([f"v2 proposals per handoff at {n} procs <= 2.1", f"{p:.2f}", p <= 2.1])
        if small:
            drift = abs(p / small["proposals_per_op"] - 1)
            rows.append(
                [
                    f"{api} proposals per handoff at {n} procs within 10% of 2 procs",
                    f"{p:.2f} vs {small['proposals_per_op']:.2f} ({drift * 100:.0f}%)",
                    drift <= 0.10,
                ]
            )
        peer_rate = con.get(peer, {}).get(n, {}).get("per_second")
        if peer_rate:
            r = ratio(big["per_second"], peer_rate)
            rows.append([f"{api} handoffs/s at {n} procs >= {factor}x {peer}", f"{r:.2f}x", r >= factor])
        rows.append([f"{api} fairness min/max at {n} procs >= 0.9", f"{big['fairness']:.2f}", big["fairness"] >= 0.9])
    for kind, by_n in con.items():
        if KINDS[kind].ours:
            lost = sum(r["lost"] + r["overlaps"] for r in by_n.values())
            rows.append([f"{kind} zero lost updates / overlaps in every contention run", str(lost), lost == 0])
    for api in ("v2", "v3"):
        trials = [t for t in results.get("killed", {}).get(f"ours-{api}", []) if "error" not in t]
        if trials:
            worst = max(t["after_kill"] for t in trials)
            rows.append([f"{api} SIGKILLed holder (ttl 3): waiter acquires <= 3.3 s", f"{worst:.2f} s", worst <= 3.3])
    for api in ("v2", "v3"):
        el = results.get("election", {}).get(f"ours-{api}")
        if el and "error" not in el:
            if el["kill"]:
                worst = max(el["kill"])
                rows.append([f"{api} election SIGKILL -> new leader <= ttl + 0.3 s", f"{worst:.2f} s", worst <= 3.3])
            if el["resign"]:
                worst = max(el["resign"])
                rows.append([f"{api} election resign -> new leader <= 30 ms", f"{worst * 1000:.0f} ms", worst <= 0.030])
    rw = results.get("rwlock", {})
    for api in ("v2", "v3"):
        lost = 0
        for work in sorted({key.split("-")[2] for key in rw}, key=int, reverse=True):
            rwl, mtx = rw.get(f"rwlock-{api}-{work}", {}), rw.get(f"mutex-{api}-{work}", {})
            if "8" in rwl and "8" in mtx:
                r = ratio(rwl["8"]["per_second"], mtx["8"]["per_second"])
                rows.append([f"{api} RWLock 90/10 at 8 procs, {work} ms work, >= 3x Mutex", f"{r:.2f}x", r >= 3])
            if len(rwl) > 1:
                values = [rwl[n]["requests_per_op"] for n in sorted(rwl, key=int)]
                spread = max(values) / min(values) - 1
                rows.append(
                    [
                        f"{api} RWLock requests per acquisition constant over {', '.join(sorted(rwl, key=int))} procs",
                        " / ".join(f"{v:.2f}" for v in values) + f" ({spread * 100:.0f}% spread)",
                        spread <= 0.15,
                    ]
                )
            lost += sum(r["lost"] + r["overlaps"] for r in list(rwl.values()) + list(mtx.values()))
        if any(key.split("-")[1] == api for key in rw):
            rows.append([f"{api} RWLock/Mutex zero lost updates / exclusion violations", str(lost), lost == 0])
    hold = results.get("hold", {}).get("ours-v3")
    if hold:
        k = hold["keepalive_per_second"]
        rows.append([f"v3 {hold['locks']} locks held: <= 1 keep-alive request/s", f"{k:.2f}/s", k <= 1])
    return rows


def check_semaphore(results: dict) -> list[list[Any]]:
    """Issue 14's targets for the semaphore of 4: proposals per acquisition, fairness, no over-admission."""
    rows: list[list[Any]] = []
    for key, by_n in results.get("semaphore", {}).items():
        limit, api = key.split("-")
        if limit == "1" or not by_n:
            continue
        proposals = {n: r["proposals_per_op"] for n, r in by_n.items()}
        most = max(proposals.values())
        rows.append(
            [
                f"{api} semaphore of {limit}: proposals per acquisition <= 2.1 at every count",
                " / ".join(f"{p:.2f}" for p in proposals.values()),
                most <= 2.1,
            ]
        )
        fairness = min(r["fairness"] for r in by_n.values())
        rows.append([f"{api} semaphore of {limit}: fairness min/max >= 0.9", f"{fairness:.2f}", fairness >= 0.9])
        over = sum(r["overlaps"] for r in by_n.values())
        rows.append([f"{api} semaphore of {limit}: over-admissions = 0", str(over), over == 0])
    return rows
