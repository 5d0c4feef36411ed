#!/usr/bin/env python3
"""Where a batch-1 request's "gather" goes, without Triton: the in-process backend's ``Instance.execute`` on host
buffers as Triton hands them over (pageable memory, wrapped, never copied), timed stage by stage.

The in-process backend measured gather 179 us, engine 139 us and respond 86 us per batch-1 run on shape 3 (H100,
docs/serving.md), where the inputs are 64 KB. This splits the gather: Python's own work (wrapping Triton's buffers),
each host-to-device copy from pageable memory, and the same rows through pinned memory. Session 28's run (at
``522aca2``) also served a lone request staged through the bucket's pinned buffers: slower, so serving has no such
route any more and the study keeps it as a piece. Each request is served twice: through the direct route
(``inprocess.DirectRoute``: memmove into pinned staging, one asynchronous copy each way, one host wait; its engine
stage includes the answer's copy) and through torch's copies (``BucketEngine.run``). Variants alternate round by
round so that drift hits them alike; medians are printed.

    python3 scripts/serving_gather_study.py --artifacts DIR [--rounds 20 --runs 100] [--json FILE]
    python3 scripts/serving_gather_study.py --artifacts DIR --device cpu   # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_config(artifacts: Path, device: str, row_shape: list[int], dtype_name: str, max_batch: int) -> dict:
    from kkdeploy.serving.triton_model import ARTIFACTS, DEVICE_TYPE, INPUT_MASK, INPUT_X, OUTPUT_Y

    return {"name": "gather-study", "max_batch_size": max_batch,
            "input": [{"name": INPUT_X, "data_type": f"TYPE_{dtype_name}", "dims": row_shape},
                      {"name": INPUT_MASK, "data_type": "TYPE_BOOL", "dims": row_shape[:1]}],
            "output": [{"name": OUTPUT_Y, "data_type": f"TYPE_{dtype_name}", "dims": row_shape}],
            "parameters": {ARTIFACTS: {"string_value": str(artifacts.resolve())},
                           DEVICE_TYPE: {"string_value": "cuda" if device.startswith("cuda") else "cpu"}}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifacts", type=Path, required=True, help="a `kkdeploy build` directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--runs", type=int, default=100, help="executions per variant per round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from kkdeploy import artifacts as kk_artifacts
    from kkdeploy.config import TransformerConfig
    from kkdeploy.config import dtype_name as kk_dtype_name
    from kkdeploy.inputs import generate_case
    from kkdeploy.serving import inprocess
    from kkdeploy.serving.triton_model import BucketEngine

    manifest = json.loads((args.artifacts / kk_artifacts.MANIFEST).read_text())
    config = TransformerConfig(**manifest["config"])
    dtype = getattr(torch, manifest["dtype"])
    sizes = (manifest.get("batch_buckets") or {}).get("sizes") or [config.batch_size]
    row_shape = [config.seq_len, config.d_model]
    triton_type = {"float16": "FP16", "float32": "FP32", "bfloat16": "BF16"}[kk_dtype_name(dtype)]
    cfg = model_config(args.artifacts, args.device, row_shape, triton_type, max(sizes))
    model = inprocess.Model(json.dumps(cfg), str(args.artifacts.parent), 1)
    instance = inprocess.Instance(model, "gather-study_0", "GPU" if args.device.startswith("cuda") else "CPU", 0)
    engine: BucketEngine = instance.engine

    # One request of one sequence, in pageable host memory as Triton holds it: (shape, [(pointer, bytes, type, id)]).
    x, _ = generate_case(dataclasses.replace(config, batch_size=1), "cpu", dtype, 1234)
    host_x = np.ascontiguousarray(x.view(torch.uint8).numpy()) if dtype != torch.float32 else x.numpy().copy()
    host_mask = np.ones([1, config.seq_len], dtype=np.bool_)
    x_desc = ([1, *row_shape], [(host_x.ctypes.data, host_x.nbytes, inprocess.MEMORY_CPU, 0)])
    mask_desc = ([1, config.seq_len], [(host_mask.ctypes.data, host_mask.nbytes, inprocess.MEMORY_CPU, 0)])
    requests = {"mask sent": [(x_desc, mask_desc)], "no mask": [(x_desc, None)]}

    direct = instance.direct  # the direct route (memmove, one copy each way, one wait) where it serves

    def execute(reqs, route):
        instance.direct = direct if route == "direct" else None
        outcomes, runs = instance.execute(reqs)
        assert all(len(o) == 4 for o in outcomes), outcomes
        return runs[0]

    # an all-True mask sent, or none; through the direct route and through torch's copies: the same bits
    routes = ["direct", "torch copies"] if direct is not None else ["torch copies"]
    variants = {f"{name}, {route}": (reqs, route) for route in routes for name, reqs in requests.items()}
    stats = {name: {"gather": [], "engine": [], "respond": [], "execute": []} for name in variants}
    answers = {}
    for name, (reqs, route) in variants.items():  # warm up, and the answer of each route for the bitwise check
        for _ in range(20):
            execute(reqs, route)
        answers[name] = bytes(instance.last[0].cpu().reshape(-1).view(torch.uint8).numpy())
    same = len(set(answers.values())) == 1

    # The pieces on their own: one pageable copy of x and of the mask to the device, and the pinned alternative.
    pieces = {}
    if engine.cuda:
        dev_x = torch.empty([1, *row_shape], dtype=dtype, device=engine.device)
        dev_m = torch.empty([1, config.seq_len], dtype=torch.bool, device=engine.device)
        pin_x = torch.empty([1, *row_shape], dtype=dtype, pin_memory=True)
        src_x = inprocess.input_tensor(x_desc, dtype)
        src_m = inprocess.input_tensor(mask_desc, torch.bool)

        def timed(fn, n=500):
            for _ in range(20):
                fn()
            out = []
            for _ in range(n):
                t = time.perf_counter_ns()
                fn()
                torch.cuda.current_stream().synchronize()
                out.append((time.perf_counter_ns() - t) / 1e3)
            return statistics.median(out)

        pieces["wrap x and mask (Python)"] = timed(lambda: (inprocess.input_tensor(x_desc, dtype),
                                                            inprocess.input_tensor(mask_desc, torch.bool)))
        pieces["x: pageable -> device"] = timed(lambda: dev_x.copy_(src_x, non_blocking=True))
        pieces["mask: pageable -> device"] = timed(lambda: dev_m.copy_(src_m, non_blocking=True))
        pieces["x: pageable -> pinned -> device"] = timed(
            lambda: dev_x.copy_(pin_x.copy_(src_x), non_blocking=True))
        pieces["empty stream sync"] = timed(lambda: None)
        dev_y = torch.empty([1, *row_shape], dtype=dtype, device=engine.device)
        pin_y = torch.empty([1, *row_shape], dtype=dtype, pin_memory=True)
        pieces["answer: device -> pinned (respond)"] = timed(lambda: pin_y.copy_(dev_y, non_blocking=True))

    for _ in range(args.rounds):
        for name, (reqs, route) in variants.items():
            for _ in range(args.runs):
                t = time.perf_counter_ns()
                gather, eng, respond, _, _ = execute(reqs, route)
                total = time.perf_counter_ns() - t
                for key, ns in (("gather", gather), ("engine", eng), ("respond", respond), ("execute", total)):
                    stats[name][key].append(ns / 1e3)

    medians = {name: {k: round(statistics.median(v), 1) for k, v in s.items()} for name, s in stats.items()}
    result = {"artifacts": str(args.artifacts), "device": torch.cuda.get_device_name() if engine.cuda else "cpu",
              "host_waits": inprocess.cuda_sync_mode() if engine.cuda else None,
              "torch": torch.__version__, "buckets": engine.described, "static": sorted(engine.static),
              "runs_per_variant": args.rounds * args.runs, "bitwise_same_answers": same,
              "medians_us": medians, "pieces_us": {k: round(v, 1) for k, v in pieces.items()}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"{result['device']}, torch {torch.__version__}, buckets {engine.described}; "
          f"{args.rounds * args.runs} executions per variant; every route's answer bitwise the same: {same}; "
          f"host waits for the GPU: {result['host_waits']}")
    for name, value in result["pieces_us"].items():
        print(f"  piece: {name:<34} {value:8.1f} us")
    print(f"{'variant':<24} {'gather':>8} {'engine':>8} {'respond':>8} {'execute':>8}  (us, medians)")
    for name, m in medians.items():
        print(f"{name:<24} {m['gather']:8.1f} {m['engine']:8.1f} {m['respond']:8.1f} {m['execute']:8.1f}")
    instance.finalize()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
