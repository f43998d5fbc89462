"""The figures of docs/reliability.md, from what the fault suite measured.

    python -m tests.reliability_report report.json docs/reliability.md

``report.json`` is what tests/test_cluster_faults.py writes when ETCDLOCK_RELIABILITY_JSON
names it (scripts/reliability does both). The figures replace what stands between the
``<!-- figures -->`` and ``<!-- end of figures -->`` markers of the Markdown file; the rest
of the file, the prose, is left as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- figures -->", "<!-- end of figures -->"
VERSION, UNKNOWN = "etcd", "?"
WORKLOADS = ("mutex", "rwlock", "election", "tasks", "beat")
KINDS = {
    "etcd3.4-v2": "etcd 3.4, v2 API",
    "etcd3.4-v3": "etcd 3.4, v3 API",
    "etcd3.5-v2": "etcd 3.5, v2 API",
    "etcd3.5-v3": "etcd 3.5, v3 API",
    "etcd3.6-v3": "etcd 3.6, v3 API",
    "etcd3.7-v3": "etcd 3.7, v3 API",
}
TOTALS = {  # safety counter -> what the totals table calls it
    "increments": "mutex: increments of the shared counter",
    "rw reads": "rwlock: reads",
    "rw writes": "rwlock: writes",
    "leaderships": "election: leaderships",
    "task runs": "tasks: singleton runs",
    "task skips": "tasks: runs skipped (lock held)",
    "beat runs": "beat: periodic runs sent",
    "errors_survived": "etcd errors a workload survived",
}
INFORMATION = {  # counters that are no violation
    "beat messages published": "beat: messages published (from the beats' logs)",
    "beat runs recorded in etcd": "beat: runs recorded in etcd (the state's run count)",
    "beat runs sent late (within half an interval of the next)": (
        "beat: runs sent late, within half an interval of the next (a slow recording; not a run sent twice)"
    ),
    "mutex holds lost inside": "mutex: holds lost during the critical section (none overlapped)",
    "task runs that lost their lock": "tasks: runs that lost their lock before they ended",
    "overlaps from a live lease a resumed old leader revoked (etcd#15247)": (
        "overlaps etcd caused: a live lease revoked by a resumed old leader (etcd#15247, see below)"
    ),
}


def seconds(value: float) -> str:
    return f"{value:.1f}"


def render(report: dict[str, Any], command: str) -> str:
    kinds = [kind for kind in KINDS if kind in report]
    meta = report.get("_meta", {})
    lines = [
        f"Measured by `{command}` on {meta.get('date', '?')}: {meta.get('cores', '?')} cores, "
        f"{', '.join(f'{KINDS[k]} = etcd {report[k].get(VERSION, UNKNOWN)}' for k in kinds)}; "
        f"the whole run took {meta.get('minutes', '?')} minutes. Liveness bound: "
        f"{seconds(report[kinds[0]]['bound'])} s (derived above).",
        "",
        "**Recovery**: seconds until every workload (and every lock process) moved again, after the fault "
        "struck / after it was healed; in brackets the longest any workload stood still during the fault. "
        "Quorum loss: how long nothing moved, as it must not, then the recovery once the quorum was back.",
        "",
    ]
    faults = list(dict.fromkeys(f for k in kinds for f in report[k]["faults"]))
    lines.append("| fault | " + " | ".join(KINDS[k] for k in kinds) + " |")
    lines.append("|---|" + "---|" * len(kinds))
    for fault in faults:
        cells = []
        for kind in kinds:
            found = report[kind]["faults"].get(fault)
            cells.append(_recovery_cell(found) if found else "-")
        lines.append(f"| {fault} | " + " | ".join(cells) + " |")
    lines += ["", "**Per workload**, the slowest phase of each fault (seconds until it moved again):", ""]
    for kind in kinds:
        lines += [f"<details><summary>{KINDS[kind]}</summary>", ""]
        lines.append("| fault | " + " | ".join(WORKLOADS) + " | slowest lock client | operations during the fault |")
        lines.append("|---|" + "---|" * (len(WORKLOADS) + 2))
        for fault, found in report[kind]["faults"].items():
            worst = {w: max(p["recovery"][w] for p in found["phases"]) for w in WORKLOADS} if found["phases"] else {}
            slowest = max((p["slowest_client"] for p in found["phases"]), default=0.0)
            ops = ", ".join(f"{w} {found['ops'][w]}" for w in WORKLOADS)
            lines.append(
                f"| {fault} | "
                + " | ".join(seconds(worst.get(w, 0.0)) for w in WORKLOADS)
                + f" | {seconds(slowest)} | {ops} |"
            )
        lines += ["", "</details>", ""]
    lines += ["**Work done and safety**, over the whole run of each cluster kind (every fault in turn):", ""]
    lines.append("| | " + " | ".join(KINDS[k] for k in kinds) + " |")
    lines.append("|---|" + "---|" * len(kinds))
    counters = sorted({c for k in kinds for c in report[k]["safety"]})
    safety = [c for c in counters if c not in TOTALS and c not in INFORMATION]
    for counter in [*TOTALS, *INFORMATION, *safety]:
        label = TOTALS.get(counter) or INFORMATION.get(counter) or f"**{counter}** (must be 0)"
        lines.append(f"| {label} | " + " | ".join(str(report[k]["safety"].get(counter, 0)) for k in kinds) + " |")
    lines.append("")
    return "\n".join(lines)


def _recovery_cell(fault: dict[str, Any]) -> str:
    phases = [max(p["recovery"].values()) for p in fault["phases"]]
    pause = max(fault["longest_pause"].values())
    if fault["closed"]:
        closed = "+".join(seconds(c) for c in fault["closed"])
        return f"closed {closed} s, then {' / '.join(seconds(p) for p in phases)}"
    return f"{' / '.join(seconds(p) for p in phases)} ({seconds(pause)})"


def main(argv: list[str]) -> None:
    source, target = Path(argv[1]), Path(argv[2])
    command = argv[3] if len(argv) > 3 else "scripts/reliability"
    figures = render(json.loads(source.read_text()), command)
    text = target.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{target} has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    target.write_text(f"{head}{BEGIN}\n{figures}\n{END}{tail}")


if __name__ == "__main__":
    main(sys.argv)
