"""Does each GPU runner reproduce eager, alone and next to ONNX Runtime? (one shape, fresh processes)

    python scripts/gpu_selfcheck.py --shape 3            # prints one line per scenario, JSON to $OUT

Scenarios, each in its own process so library load order is what the scenario says:
  graph-alone       CUDA-graph runner loaded from saved weights; no onnxruntime in the process
  graph-after-ort   onnxruntime imported and its CUDA DLLs preloaded before torch touches cuBLAS
  graph-warm-ort    torch runs a GEMM first, then onnxruntime is imported, then capture
  graph-with-ort-session  an ORT CUDA-graph session is created and run before the capture
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = ["graph-alone", "graph-after-ort", "graph-warm-ort", "graph-with-ort-session"]


def scenario(name: str, shape: int) -> dict:
    import torch

    if name == "graph-warm-ort":
        a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
        (a @ a).sum().item()
    if name in ("graph-after-ort", "graph-warm-ort", "graph-with-ort-session"):
        import onnxruntime as ort

        ort.preload_dlls()
    from safetensors.torch import load_file, save_file

    from engines.torch_graph import VARIANTS, CudaGraphRunner, model_for_variant
    from kkdeploy import generate_case, official_config
    from kkdeploy.models.weights import build_models

    config = official_config(shape)
    dev = torch.device("cuda")
    ref, _ = build_models(config, torch.float16, dev)
    tmp = Path(tempfile.mkdtemp())
    save_file({k: v.detach().cpu().contiguous() for k, v in ref.state_dict().items()}, str(tmp / "w.safetensors"))
    if name == "graph-with-ort-session":
        from exporters import export_onnx

        export_onnx(ref, config, torch.float16, tmp / "m.onnx")
        sess = ort.InferenceSession(str(tmp / "m.onnx"),
                                    providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        from engines.ort import OrtRunner

        ort_runner = OrtRunner(sess, config, torch.float16, dev, cuda_graph=True)
        x0, m0 = generate_case(config, dev, torch.float16, 0)
        ort_runner(x0, m0)
    state = load_file(str(tmp / "w.safetensors"))
    out = {}
    for variant in VARIANTS:
        model = model_for_variant(VARIANTS[variant], config, torch.float16, dev, state)
        runner = CudaGraphRunner(model, config, torch.float16, dev, VARIANTS[variant]["all_valid_only"])
        x, m = generate_case(config, dev, torch.float16, 1234)
        with torch.inference_mode():
            expected = ref(x, m)
            got = runner(x, m)
        out[variant] = {"nan": int(torch.isnan(got).sum()), "bitwise": bool(torch.equal(expected, got)),
                        "max_abs": float((expected.float() - got.float()).abs().max())}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, default=3)
    p.add_argument("--scenario", choices=SCENARIOS)
    args = p.parse_args()
    if args.scenario:
        print("RESULT " + json.dumps(scenario(args.scenario, args.shape)))
        return 0
    results = {}
    for name in SCENARIOS:
        proc = subprocess.run([sys.executable, __file__, "--shape", str(args.shape), "--scenario", name],
                              capture_output=True, text=True, timeout=240)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        results[name] = json.loads(line[7:]) if line else {"error": (proc.stderr or proc.stdout)[-1500:]}
        print(name, json.dumps(results[name]))
    out = Path(os.environ.get("OUT", ".")) / "selfcheck.json"
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
