"""One CUDA-graph capture for every graph-replaying runner (torch-graph, inductor, torch-compile).

Static input buffers are filled by copy before each replay; the caller gets a clone of the static
output, because the next replay overwrites it (design.md §7: the caller owns every output).

The graph keeps its ``cudaGraph_t`` after capture (``keep_graph``, torch >= 2.8) so that the bench can count its
nodes (``kkdeploy.pipeline.launches``); the executable graph it replays is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

WARMUP_CALLS = 3


@dataclass(frozen=True)
class StaticCall:
    """A captured graph's own input buffers and its replay. A caller that writes its inputs straight into ``x`` and
    ``mask`` (every row, every call) and then calls ``run()`` skips a call's two copies in and its clone out, and the
    runner's checks: a server's gather already built exactly these tensors. ``run()`` returns the graph's static
    output, which the next replay overwrites, so the caller copies it out (or is done with it) before then."""

    x: torch.Tensor
    mask: torch.Tensor
    run: Callable[[], torch.Tensor]
    #: the static output ``run()`` returns, and the executable graph (``cudaGraphExec_t``, 0 where this torch does
    #: not give it): what a caller outside Python (the in-process backend's native route) replays and reads
    y: Optional[torch.Tensor] = None
    graph_exec: Callable[[], int] = lambda: 0


def new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """(graph, kept): a graph that keeps its cudaGraph_t for inspection where this torch can, else a plain one."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # torch < 2.8: no keep_graph; nodes cannot be counted, replay is unchanged
        return torch.cuda.CUDAGraph(), False


class CapturedCall:
    """``fn(x, mask)`` captured once on static buffers of the model's fixed shape."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: int, seq: int, width: int,
                 dtype: torch.dtype, device: torch.device, warmups: int = WARMUP_CALLS, all_valid_only: bool = False):
        """``all_valid_only``: the caller only ever passes all-True masks (it checks them), so the static mask,
        captured all True, already holds every call's mask and is not copied again per replay."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError("CUDA-graph capture needs a CUDA device")
        self.all_valid_only = all_valid_only
        self.fn = fn  # the graph reads memory this callable owns (parameters, compiled kernels): keep it alive
        self.x = torch.zeros(batch, seq, width, dtype=dtype, device=device)
        self.mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():  # lazy init and allocator warm-up off the capture
            for _ in range(warmups):
                fn(self.x, self.mask)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph, self.graph_kept = new_graph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.y = fn(self.x, self.mask)
        if self.graph_kept:
            self.graph.instantiate()  # a kept graph is not instantiated at capture end; do it now, not on first replay
        torch.cuda.synchronize(device)

    @property
    def ops_outside_graph(self) -> int:
        """Stream operations a call issues besides the replay: the input copy, the mask copy (unless
        all-valid-only) and the output clone."""
        return 2 if self.all_valid_only else 3

    def static_call(self) -> Optional[StaticCall]:
        """The capture's buffers and replay for a caller that fills them itself; None for an all-valid-only capture,
        whose mask buffer stays all True and is never copied."""
        if self.all_valid_only:
            return None
        return StaticCall(self.x, self.mask, self._replay, self.y, self._graph_exec)

    def _graph_exec(self) -> int:
        """The executable graph ``_replay`` launches (``cudaGraphExec_t``), or 0 where this torch cannot give it.
        Launching it is what ``replay()`` does for a graph without random numbers (none here: inference)."""
        raw = getattr(self.graph, "raw_cuda_graph_exec", None)
        return int(raw()) if self.graph_kept and callable(raw) else 0

    def _replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.y

    def raw_graph(self) -> int | None:
        """The captured cudaGraph_t (an address), or None where this torch cannot keep it."""
        return self.graph.raw_cuda_graph() if self.graph_kept else None

    def close(self) -> None:
        """Free the graph's memory pool now, then the static buffers and the callable whose memory it read."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.x = self.mask = self.y = self.fn = None

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        if not self.all_valid_only:
            self.mask.copy_(mask)
        self.graph.replay()
        return self.y.clone()
