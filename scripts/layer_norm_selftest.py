#!/usr/bin/env python3
"""Issue 19 on the GPU: is the rows LayerNorm kernel (kkdeploy/kernels/csrc/layer_norm.cu) bit-identical to ATen?

Both launches are checked: one row per warp and two rows per warp (16-lane halves: the op's launch since campaign 11).

A. Every nn.LayerNorm of the seeded FP16 ReferenceTransformer on each official shape whose rows it covers
   (D <= 128: shapes 1-7 and 9-13), official input (seed 1234) all-valid and padded 0.25: a forward hook feeds
   the module's real input to the kernel and counts the elements whose bits differ from the module's output.
B. Random rows: widths 4..128, input scales 1e-3..1e3, a non-zero mean, and weight/bias away from identity
   (trained-like LayerNorms), 4096 rows each.
C. Timing on shape 6's rows (1.28M x 128): the kernel against F.layer_norm, CUDA events, median of --repeats.

    python3 scripts/layer_norm_selftest.py --out $OUT/layer-norm.json

Prints a table last; exits 0 even when something differs (the table says what).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kkdeploy import OFFICIAL_SHAPES, generate_case  # noqa: E402
from kkdeploy.kernels.cuda_build import platform_key  # noqa: E402
from kkdeploy.kernels.layer_norm import MAX_ROW, layer_norm_rows_kernel  # noqa: E402
from kkdeploy.kernels.timing import cuda_median_ms, differing_bits as differing  # noqa: E402
from kkdeploy.models.weights import build_models  # noqa: E402


def model_checks(shapes: list[int], device) -> list[dict]:
    rows = []
    for shape in shapes:
        config = OFFICIAL_SHAPES[shape]
        if config.d_model > MAX_ROW:
            rows.append({"check": "model", "shape": shape, "skipped": f"D = {config.d_model} > {MAX_ROW}"})
            continue
        model = build_models(config, torch.float16, device)[0]
        row = {"check": "model", "shape": shape, "calls": 0, "elements": 0, "differing": 0, "first": None,
               "differing_2_rows_per_warp": 0}

        def hook(module, inputs, output, name):
            x = inputs[0].contiguous()
            n = differing(layer_norm_rows_kernel(x, module.weight, module.bias, module.eps, 1), output)
            row["calls"] += 1
            row["elements"] += output.numel()
            row["differing"] += n
            row["differing_2_rows_per_warp"] += differing(
                layer_norm_rows_kernel(x, module.weight, module.bias, module.eps, 2), output)
            if n and row["first"] is None:
                row["first"] = name

        handles = [m.register_forward_hook(lambda mod, i, o, name=name: hook(mod, i, o, name))
                   for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
        for ratio in (0.0, 0.25):
            x, mask = generate_case(config, device, torch.float16, 1234, padding_ratio=ratio)
            with torch.inference_mode():
                model(x, mask)
        torch.cuda.synchronize()
        for h in handles:
            h.remove()
        rows.append(row)
        print(f"shape {shape}: {row['calls']} LayerNorm calls, {row['differing']} differing of {row['elements']}",
              flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def random_checks(device, generator) -> list[dict]:
    rows = []
    for width in (4, 8, 32, 64, 96, 124, 128):
        for scale in (1e-3, 1.0, 30.0, 1e3):
            x = ((torch.randn(4096, width, device=device, generator=generator) + 0.5) * scale).half()
            w = (1 + 0.3 * torch.randn(width, device=device, generator=generator)).half()
            b = (0.2 * torch.randn(width, device=device, generator=generator)).half()
            ref = F.layer_norm(x, (width,), w, b, 1e-5)
            for rows_per_warp in (1, 2):  # an odd row count: the last warp of the 2-row launch has one row
                got = layer_norm_rows_kernel(x[:4095], w, b, 1e-5, rows_per_warp)
                rows.append({"check": "random", "rows_per_warp": rows_per_warp, "width": width, "scale": scale,
                             "elements": got.numel(), "differing": differing(got, ref[:4095])})
    return rows


def timing(device, generator, repeats: int) -> dict:
    x = torch.randn(10000 * 128, 128, device=device, generator=generator).half()
    w = torch.ones(128, device=device, dtype=torch.float16)
    b = torch.zeros(128, device=device, dtype=torch.float16)
    ref = F.layer_norm(x, (128,), w, b, 1e-5)
    return {"check": "timing", "rows": x.shape[0], "width": 128,
            "kernel_ms": cuda_median_ms(lambda: layer_norm_rows_kernel(x, w, b, 1e-5, 1), repeats),
            "kernel_2_rows_per_warp_ms": cuda_median_ms(lambda: layer_norm_rows_kernel(x, w, b, 1e-5, 2), repeats),
            "aten_ms": cuda_median_ms(lambda: F.layer_norm(x, (128,), w, b, 1e-5), repeats),
            "differing": differing(layer_norm_rows_kernel(x, w, b, 1e-5, 1), ref),
            "differing_2_rows_per_warp": differing(layer_norm_rows_kernel(x, w, b, 1e-5, 2), ref)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=int, nargs="*", default=list(range(1, 14)))
    p.add_argument("--out", type=Path, default=Path("layer-norm.json"))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_norm_selftest: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(11)
    start = time.perf_counter()
    rows = []
    try:
        rows += model_checks(args.shapes, device)
        rows += random_checks(device, generator)
        rows.append(timing(device, generator, args.repeats))
    except Exception as exc:  # a build or launch failure is a result too
        rows.append({"check": "error", "error": f"{type(exc).__name__}: {exc}"})
    (major, minor), version, cuda = platform_key(device)
    report = {"platform": {"capability": [major, minor], "torch": version, "cuda": cuda,
                           "gpu": torch.cuda.get_device_name(0)},
              "weights": "seeded (init_weights seed 0) for the model checks", "seconds": round(time.perf_counter() - start, 1),
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    total = sum(r.get("differing", 0) + r.get("differing_2_rows_per_warp", 0) for r in rows)
    print(f"\nrows LayerNorm vs F.layer_norm on {report['platform']}: {total} differing elements in all")
    for r in rows:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
