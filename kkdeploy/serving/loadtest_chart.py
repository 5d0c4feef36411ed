"""The load test's picture: where a request's time goes, and how its latencies spread.

Why a picture. The tables give p50/p90/p99 and a per-request breakdown; what they hide is the shape of the tail (a
p99 that is one slow phase, or a long ramp) and how much of a request is the server's at all. Left: each run's
latency distribution (a CDF on a log axis), with the engine alone at the run's bucket as a dashed line where it was
timed. Right: each run's mean request split into the client and network, Triton's queue, input, inference and
output (Triton's own counters), so a load generator that is the bottleneck shows as a long first segment.
"""

from __future__ import annotations

from pathlib import Path

#: Triton's per-request counters, in the order a request meets them
STAGES = [("queue", "queue_duration_us_per_request"), ("input", "compute_input_duration_us_per_request"),
          ("infer", "compute_infer_duration_us_per_request"), ("output", "compute_output_duration_us_per_request")]


def run_label(summary: dict) -> str:
    """The run's own name where a study gave it one, else its protocol, loop, client and shared memory."""
    if summary.get("name"):
        return summary["name"]
    plan = summary["plan"]
    loop = f"c={plan['concurrency']}" if summary["loop"] == "closed" else f"{plan['rate']:g}/s"
    client = plan.get("client", "lean") if plan["protocol"] == "grpc" else "tritonclient"
    shm = "" if plan.get("shared_memory", "none") == "none" else f", {plan['shared_memory']} shm"
    return f"{plan['protocol']} {loop}, {client}{shm}"


def time_split_ms(summary: dict) -> list[tuple[str, float]]:
    """The mean request as ``[(part, ms)]``: client and network (the client's mean less Triton's request time), then
    Triton's stages. Empty when Triton's counters are missing."""
    server = summary.get("server") or {}
    total = server.get("request_duration_us_per_request")
    mean = (summary.get("latency_ms") or {}).get("mean")
    if total is None or mean is None:
        return []
    parts = [("client + network", max(mean - total / 1000, 0.0))]
    parts += [(name, (server.get(key) or 0.0) / 1000) for name, key in STAGES]
    return parts


def plot_load(path: Path, results: list[dict], direct: dict | None = None) -> Path:
    """Writes the picture of ``results`` (``run_load`` summaries) to ``path``; ``direct``: ``direct_engine``'s timings,
    drawn where a run's requests are of one batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 2.2 + 0.9 * max(len(results), 2)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, summary in enumerate(results):
        color = colors[i % len(colors)]
        points = summary.get("latency_cdf_ms") or []
        if points:
            fractions = [k / (len(points) - 1) for k in range(len(points))] if len(points) > 1 else [1.0]
            left.step(points, fractions, where="post", color=color, label=run_label(summary))
        sizes = [int(n) for n in summary.get("latency_ms_by_batch") or {}]
        if direct and len(sizes) == 1:
            buckets = sorted(int(b) for b in direct)
            bucket = next((b for b in buckets if b >= sizes[0]), None)
            if bucket is not None:
                left.axvline(direct[str(bucket)]["median_ms"], color=color, linestyle="--", linewidth=1)
    left.set_xscale("log")
    left.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("latency, ms (dashed: the engine alone at the run's bucket)")
    left.set_ylabel("fraction of requests")
    left.set_ylim(0, 1.01)
    left.grid(True, which="both", alpha=0.3)
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=8, loc="lower right")
    left.set_title("latency distribution")
    names = [run_label(s) for s in results]
    stage_colors = {"client + network": "tab:gray", "queue": "tab:orange", "input": "tab:blue", "infer": "tab:green",
                    "output": "tab:purple"}
    drawn = set()
    for row, summary in enumerate(results):
        start = 0.0
        for part, ms in time_split_ms(summary):
            right.barh(row, ms, left=start, color=stage_colors[part], label=None if part in drawn else part)
            drawn.add(part)
            start += ms
    right.set_yticks(range(len(results)), names, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("mean request, ms")
    right.set_title("where the time goes (Triton's counters)")
    height = fig.get_size_inches()[1]
    if drawn:
        right.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=5, frameon=False,
                     bbox_transform=fig.transFigure)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room below for the stages' legend
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    fig.savefig(partial, dpi=100, format="png")
    plt.close(fig)
    partial.replace(path)  # never half a picture
    return path
