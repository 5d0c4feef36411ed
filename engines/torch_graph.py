"""PyTorch CUDA-graph candidates: the reference order, and the optimized model's fast path.

Replaying a captured graph runs the same kernels on the same addresses as eager, so the
reference-order capture is bitwise identical to eager while removing launch overhead
(design.md §6). The optimized capture (packed QKV + SDPA in the last k layers) has no mask
branch inside the graph, so it serves all-valid calls only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kkdeploy.artifacts import WEIGHTS_FILE
from kkdeploy.config import TransformerConfig
from kkdeploy.errors import KKError
from kkdeploy.inputs import AllValidMaskCache

from .base import BUILT, Backend, BuildContext, CandidateResult, Runner
from .cuda_graph import CapturedCall
from .registry import BackendChoice, BackendDescriptor, register

VARIANTS = {
    "torch-graph": {"model": "reference", "sdpa_layers": 0, "all_valid_only": False},
    "torch-graph-sdpa1": {"model": "optimized", "sdpa_layers": 1, "all_valid_only": True},
    # Reference-order attention without the mask ops (all-valid calls only): the same kernels as
    # eager minus masked_fill/where no-ops, so bitwise; on the H200 the uncaptured form beat the
    # masked capture on shapes 8 and 13 (docs/results.md). Its own capture is not measured yet.
    "torch-graph-nomask": {"model": "optimized", "sdpa_layers": 0, "all_valid_only": True},
}


class CudaGraphRunner(Runner):
    """Static input buffers filled by copy; the output is cloned so the caller owns it."""

    backend = "torch-graph"

    def __init__(self, model, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 all_valid_only: bool, forward=None):
        """``forward(x, mask)`` is what gets captured: by default the model's all-valid fast path for an
        all-valid-only runner, else its reference order (a model with another all-mask path passes it)."""
        super().__init__(config, dtype, device)
        if self.device.type != "cuda":
            raise KKError("CUDA-graph runners need a CUDA device")
        self.all_valid_only = all_valid_only
        self.model = model  # the graph reads these parameters' memory: they must outlive it
        self._mask_cache = AllValidMaskCache()
        if forward is None and all_valid_only:
            forward = lambda x, mask: model.fast_forward(x)  # noqa: E731
        elif forward is None:
            forward = model.reference_forward
        self.captured = CapturedCall(forward, config.batch_size, config.seq_len, config.d_model, dtype, self.device,
                                     all_valid_only=all_valid_only)

    def infer(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.all_valid_only and not self._mask_cache.is_all_valid(mask):
            raise KKError(f"{self.backend} serves all-valid calls only; route padded calls to the fallback")
        return self.captured(x, mask)

    def static_call(self):
        return self.captured.static_call()  # None for an all-valid-only capture

    def release(self) -> None:
        self.captured.close()  # the graph first: it reads the model's memory
        self.captured = self.model = None


def model_for_variant(variant: dict, config: TransformerConfig, dtype: torch.dtype, device: torch.device,
                      state_dict: dict):
    from kkdeploy.models.optimized import OptimizedTransformer
    from kkdeploy.models.reference import ReferenceTransformer

    if variant["model"] == "reference":
        model = ReferenceTransformer(config)
    else:
        model = OptimizedTransformer(config, sdpa_layers=variant["sdpa_layers"])
    model.load_state_dict(state_dict, strict=True)
    return model.to(device=device, dtype=dtype).eval()


class TorchGraphBackend(Backend):
    name = "torch_graph"

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return "unavailable: CUDA graphs need a CUDA device"
        return None

    def candidates(self, ctx: BuildContext) -> list[str]:
        wanted = ctx.candidate_filter
        return [n for n in VARIANTS if wanted is None or n in wanted]

    def build(self, ctx: BuildContext, candidate: str) -> CandidateResult:
        # Nothing to compile ahead of time: capture happens at load, on the serving GPU.
        return CandidateResult(name=candidate, backend=self.name, status=BUILT, files=[WEIGHTS_FILE],
                               options=dict(VARIANTS[candidate]))

    def load(self, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
             device: torch.device) -> CudaGraphRunner:
        from safetensors.torch import load_file

        state = load_file(str(Path(artifact_dir) / WEIGHTS_FILE))
        model = model_for_variant(entry["options"], config, dtype, device, state)
        runner = CudaGraphRunner(model, config, dtype, device, entry["options"]["all_valid_only"])
        runner.backend = entry["name"]
        return runner


BACKEND = TorchGraphBackend()
# Its mixed-precision routes are bench-only (kkdeploy.pipeline.bench), so its recipes keep the model's dtype.
DESCRIPTOR = register(BackendDescriptor(
    key=TorchGraphBackend.name, module=__name__, recipe_name="torch-graph", libraries=("torch",),
    choices=(BackendChoice("torch-graph", default_on=("cuda",)),),
    default_variants=lambda device, dtype, contract: list(VARIANTS),
    attentions=frozenset({"reference", "reference-nomask", "sdpa-last"})))
