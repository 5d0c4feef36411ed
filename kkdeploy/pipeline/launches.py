"""How many launches one timed call of a runner issues: counted, never guessed.

The launch term of the roofline (``kkdeploy.pipeline.roofline``) needs a count, and there are two honest ones:

* a captured call (``engines.cuda_graph.CapturedCall``): the nodes of its CUDA graph that do device work (kernels,
  memcpys, memsets), read from the driver (``cuGraphGetNodes``), plus the stream operations the call issues around
  the replay (input copy, mask copy, output clone). Exact, and free: nothing runs;
* an uncaptured call on a GPU: the device kernels, memcpys and memsets torch.profiler (CUPTI) records over one call.
  Deterministic for a fixed shape, so the bench counts it in its first process only (CUPTI's start-up is not free).

On the CPU nothing is counted: an op there is not a launch, and a number would be a guess.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import torch

#: CUgraphNodeType (cuda.h) -> name
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}
LAUNCHED = ("kernel", "memcpy", "memset")  # node kinds that run on the device, each one a launch
CHILD_GRAPH = 4
CPU_REASON = "not counted on the CPU: an op there is not a kernel launch, and a count would be a guess"


class CudaDriverGraphs:
    """The three graph queries the count needs, from the CUDA driver (``libcuda.so.1``, loaded by every CUDA process;
    a runtime ``cudaGraph_t`` is a driver ``CUgraph``)."""

    def __init__(self, lib=None):
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} returned CUresult {result}")

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._check(self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
        handles = (ctypes.c_void_p * max(count.value, 1))()
        self._check(self.lib.cuGraphGetNodes(ctypes.c_void_p(graph), handles, ctypes.byref(count)), "cuGraphGetNodes")
        return [handles[i] for i in range(count.value)]

    def node_type(self, node: int) -> int:
        kind = ctypes.c_int(-1)
        self._check(self.lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        return kind.value

    def child_graph(self, node: int) -> int:
        graph = ctypes.c_void_p(0)
        self._check(self.lib.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(graph)),
                    "cuGraphChildGraphNodeGetGraph")
        return graph.value


def graph_node_counts(graph: int, driver) -> dict[str, int]:
    """Nodes of a CUDA graph by kind, child graphs expanded (their own node is not counted)."""
    counts: Counter = Counter()
    for node in driver.nodes(graph):
        kind = driver.node_type(node)
        if kind == CHILD_GRAPH:
            counts.update(graph_node_counts(driver.child_graph(node), driver))
        else:
            counts[NODE_TYPES.get(kind, f"type-{kind}")] += 1
    return dict(counts)


def timed_capture(runner):
    """The ``CapturedCall`` an all-valid call of ``runner`` replays, or None if that call is not a graph replay.

    Follows the routers the bench's runners are made of: ``kkdeploy.load``'s ServedRunner (its engine), and an
    ``AllValidRouter`` (its all-valid route: the timed input is all-valid)."""
    from engines.base import AllValidRouter
    from engines.cuda_graph import CapturedCall

    from .runtime import ServedRunner

    for _ in range(8):  # routers nest a few levels at most
        if isinstance(runner, CapturedCall) or runner is None:
            return runner
        if isinstance(runner, AllValidRouter):
            runner = runner.all_valid
        elif isinstance(runner, ServedRunner):
            runner = runner.engine
        else:
            captured = getattr(runner, "captured", None)
            return captured if isinstance(captured, CapturedCall) else None
    return None


def captured_launches(capture, driver=None) -> dict:
    """The launches of one call of a ``CapturedCall``: its graph's device nodes plus the operations around the
    replay."""
    graph = capture.raw_graph()
    if graph is None:
        return {"count": None,
                "reason": "this torch cannot keep a captured graph (CUDAGraph keep_graph needs torch >= 2.8)"}
    nodes = graph_node_counts(graph, driver if driver is not None else CudaDriverGraphs())
    in_graph = sum(nodes.get(kind, 0) for kind in LAUNCHED)
    outside = capture.ops_outside_graph
    return {"count": in_graph + outside, "method": "CUDA-graph nodes", "graph_nodes": nodes,
            "in_graph": in_graph, "outside_graph": outside}


def device_event_kind(name: str) -> str:
    """A profiler device event's kind: memcpy, memset or kernel."""
    low = name.lower()
    return "memcpy" if low.startswith("memcpy") else "memset" if low.startswith("memset") else "kernel"


def tally_device_events(averages) -> dict[str, int]:
    """Device events by kind from ``prof.key_averages()`` (entries with ``key``, ``count``, ``device_type``)."""
    from torch.autograd import DeviceType

    counts: Counter = Counter()
    for e in averages:
        if e.device_type == DeviceType.CUDA:
            counts[device_event_kind(e.key)] += e.count
    return dict(counts)


def profiled_launches(call, device: torch.device) -> dict:
    """The device kernels, memcpys and memsets CUPTI records over one ``call()``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    kinds = tally_device_events(prof.key_averages())
    if not kinds:
        return {"count": None, "reason": "the profiler recorded no device activity (CUPTI unavailable?)"}
    return {"count": sum(kinds.values()), "method": "torch.profiler (CUPTI), one call", "device_events": kinds}


def count_launches(runner, call, device: torch.device, profile_uncaptured: bool = True) -> dict:
    """``{"count": n, "method": ...}`` for one timed call (``call()``) of ``runner``, or ``{"count": None, "reason"}``.

    A failure to count is a reason in the record, never an error of the bench."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"count": None, "reason": CPU_REASON}
    try:
        capture = timed_capture(runner)
        if capture is not None:
            counted = captured_launches(capture)
            if counted["count"] is not None or not profile_uncaptured:
                return counted
        if not profile_uncaptured:
            return {"count": None, "reason": "an uncaptured call: counted by the profiler in the first process only"}
        return profiled_launches(call, device)
    except Exception as exc:  # the count is a report, not a reason to lose the bench
        return {"count": None, "reason": f"counting failed: {type(exc).__name__}: {str(exc)[:200]}"}
