"""The lock benchmark's workloads in report order, and the Markdown report of a run's results.

Each workload module has ``run(harness)``, which measures and stores its
results under its name, and ``render(results, settings)``, its section of the
report (a heading, a table, notes).
"""

from __future__ import annotations

from bench.common import markdown_table
from bench.locks import contention, election, hold, killed, rwlock, semaphore, targets, uncontended

WORKLOADS = {
    "uncontended": uncontended,
    "contention": contention,
    "killed": killed,
    "election": election,
    "rwlock": rwlock,
    "semaphore": semaphore,
    "hold": hold,
}


def report(results: dict) -> str:
    out: list[str] = []
    for name, workload in WORKLOADS.items():
        if results.get(name):
            out += workload.render(results, results["settings"])
    rows = targets.check(results) + targets.check_semaphore(results)
    if rows:
        out += ["### Targets\n", markdown_table(["target", "measured", "met"], rows), ""]
    out += [f"- note: {note}" for note in results.get("notes", [])]
    return "\n".join(out)
