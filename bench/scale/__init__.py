"""The capacity benchmark's parts (``python -m bench.bench_scale``; the model is docs/capacity.md).

target.py     the etcd measured (a 3-member cluster or one member) and its counters: requests,
              proposals, watch events, keys, watchers, leases, CPU and resident memory
fleet.py      what runs in the host processes: many clients per process, each on its own
workloads.py  idle fleet, busy fleet, hot keys, beats, what a renewal reads: start, settle, measure
report.py     the Markdown tables, the plot, and the model's figures derived from the rows
"""
