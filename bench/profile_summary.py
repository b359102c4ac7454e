"""What a --profile trace says about the host's share of a step: per profiled step, its wall time, the host's busy
time (the wall less the time it sat in a CUDA synchronize) against the GPU's busy time (the union of its kernels,
copies and fills launched in that step), and the attention op each compiled graph calls.

    python bench/profile_summary.py runs/gpu_check/metrics.trace.json [--missing_ok]

A step is host-bound when the host is busy for longer than the GPU: the GPU then waits for launches, and a faster GPU
would not make the step faster. Kernels are matched to their step by the correlation id of the launch that made
them (a kernel may run after its step's host span ended). Without CUDA activity (a CPU run) the GPU columns are
empty. Compiled graphs are inductor's calls ("## Call CompiledFxGraph <key> ##", forward or backward) or, on older
torch, the AOT autograd functions (CompiledFunction, CompiledFunctionBackward); an attention op is any op named
*attention* or *scaled_dot_product* inside one.
"""

import argparse
import collections
import json
import os
import re

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNC = re.compile(r"cuda(Device|Stream|Event)Synchronize|cudaMemcpy(?!Async)")
GRAPH = re.compile(r"^## Call CompiledFxGraph (\S+) ##$|^(CompiledFunction(Backward)?)$")
ATTENTION = re.compile(r"attention|scaled_dot_product", re.IGNORECASE)


def union_ms(intervals):
    """Milliseconds covered by (start, end) microsecond intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def inside(event, span):
    return span["ts"] <= event["ts"] and event["ts"] + event.get("dur", 0) <= span["ts"] + span["dur"]


def step_table(events):
    """Rows (step, wall ms, host busy ms, GPU busy ms, verdict) of the profiled steps."""
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and re.fullmatch(r"step \d+", e.get("name", ""))),
        key=lambda e: e["ts"],
    )
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and "correlation" in e.get("args", {}):
            gpu[e["args"]["correlation"]].append((e["ts"], e["ts"] + e["dur"]))
    rows = []
    for step in steps:
        launched = [e for e in runtime if inside(e, step)]
        blocked = sum(e["dur"] for e in launched if SYNC.search(e["name"])) / 1e3
        busy = union_ms([i for e in launched for i in gpu.get(e.get("args", {}).get("correlation"), [])])
        wall = step["dur"] / 1e3
        host = wall - blocked
        verdict = "no CUDA activity" if not runtime else ("host-bound" if host > busy else "GPU-bound")
        rows.append((step["name"], wall, host, busy if runtime else None, verdict))
    return rows


def attention_by_graph(events):
    """{compiled graph: (calls in the window, the attention ops called inside it)}: inductor's graphs named forward or
    backward and by their cache key, else (older torch) the AOT autograd functions."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(e["pid"], e["tid"])].append(e)
    inductor = any(GRAPH.match(e["name"]).group(1) for t in by_thread.values() for e in t if GRAPH.match(e["name"]))
    graphs = {}
    for thread in by_thread.values():
        calls = [e for e in thread if (m := GRAPH.match(e["name"])) and bool(m.group(1)) == inductor]
        backward = [e for e in thread if e["name"] == "CompiledFunctionBackward"]
        ops = [e for e in thread if ATTENTION.search(e["name"]) and not GRAPH.match(e["name"])]
        for call in calls:
            key = GRAPH.match(call["name"]).group(1)
            kind = "backward" if any(inside(call, b) for b in backward) else "forward"
            name = f"{kind} {key[:12]}" if key else call["name"]
            count, found = graphs.get(name, (0, set()))
            graphs[name] = (count + 1, found | {op["name"] for op in ops if inside(op, call)})
    return graphs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="the Chrome trace --profile wrote (metrics.trace.json beside the metrics)")
    parser.add_argument(
        "--missing_ok", action="store_true", help="no trace (a run too short to profile) is said, exit 0"
    )
    args = parser.parse_args()
    if args.missing_ok and not os.path.exists(args.trace):
        print(f"no trace at {args.trace}: the run ended before its profile window (steps 3-5)")
        return
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    rows = step_table(events)
    print("| step | wall ms | host busy ms | GPU busy ms | |")
    print("| --- | --- | --- | --- | --- |")
    for name, wall, host, busy, verdict in rows:
        print(f"| {name} | {wall:.1f} | {host:.1f} | {'-' if busy is None else f'{busy:.1f}'} | {verdict} |")
    if not rows:
        print("| (no profiled step in the trace) | | | | |")
    graphs = attention_by_graph(events)
    print("\n| compiled graph | calls in the window | attention ops inside |")
    print("| --- | --- | --- |")
    for name, (count, ops) in sorted(graphs.items()):
        print(f"| {name} | {count} | {', '.join(sorted(ops)) or 'none'} |")
    if not graphs:
        print("| (no compiled graph: an eager run) | | |")


if __name__ == "__main__":
    main()
