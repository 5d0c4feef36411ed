"""A real CUDA fault inside the proof step, on a GPU: the child dies of it, the build's process does not.

Why: the CPU tests kill the proving child with signals and hangs; a sticky CUDA error (an illegal address, as
session 36's D = 32 launch hit) exists only on a GPU. This proves a model's kernel ops through
``prove_model_kernels_isolated`` with a task that, as the attention's op shape is named, launches a Triton kernel
that stores far out of bounds, then lets the real proofs go on. Expected: the child's next synchronize raises, the
attention's op shape is refused with the driver's message, a second child proves the others with the real
kernels, and this process's device still computes.

    python3 scripts/proof_fault_study.py --shape 3 [--out fault.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

TASK = "scripts.proof_fault_study:faulting_task"


def faulting_task(model, config, dtype, device, args, report):
    """``model_kernels_task`` with an out-of-bounds store launched as the attention's op shape is named."""
    import triton
    import triton.language as tl

    from kkdeploy.kernels.proof_process import model_kernels_task

    @triton.jit
    def out_of_bounds(p):
        tl.store(p + (1 << 40), 1.0)

    def faulting_report(key, message):
        report(key, message)
        if key and key.startswith("attention "):
            out_of_bounds[(1,)](torch.zeros(1, device=device))

    return model_kernels_task(model, config, dtype, device, args, faulting_report)


def main() -> int:
    from kkdeploy.config import official_config
    from kkdeploy.kernels.model_proofs import KINDS
    from kkdeploy.kernels.proof_process import prove_model_kernels_isolated
    from kkdeploy.models.weights import build_models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = official_config(args.shape)
    device = torch.device("cuda")
    model = build_models(config, torch.float16, device)[0]
    start = time.perf_counter()
    proofs = prove_model_kernels_isolated(model, config, torch.float16, device, KINDS, task=TASK, reuse=False,
                                          progress=lambda m: print(" ", m, flush=True))
    a = torch.randn(256, 256, device=device)
    healthy = bool(torch.isfinite(a @ a).all())
    torch.cuda.synchronize()
    rows = [{"op": r.op, "shape": r.shape_text, "runs": r.chosen or "aten", "reason": r.reason[:160]}
            for r in proofs.records]
    for row in rows:
        print(f"{row['op']:20} {row['shape']:52} {row['runs']:10} {row['reason']}")
    print(f"seconds {time.perf_counter() - start:.1f} phases {proofs.phases}; this process's device computes: "
          f"{healthy}")
    if args.out:
        args.out.write_text(json.dumps({"records": rows, "phases": proofs.phases, "healthy": healthy}, indent=1))
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
