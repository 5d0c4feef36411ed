"""Which way of loading an AOTInductor package works on this GPU? Each attempt in its own process.

    python scripts/inductor_probe.py --shape 3       # prints one line per attempt, then BEST <env>

A segfault inside ``aoti_load_package`` cannot be caught, so each load mode runs in a child process:
  st1-idx   run_single_threaded=True, device_index given   (the runner's default)
  st0-idx   run_single_threaded=False, device_index given
  st0       run_single_threaded=False, no device_index
  plain     a package compiled WITHOUT the opaque-op wrappers (isolates the custom ops)
The BEST line is the environment for engines/inductor.py (KKDEPLOY_AOTI_*), or NONE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "st1-idx": {"KKDEPLOY_AOTI_SINGLE_THREADED": "1", "KKDEPLOY_AOTI_DEVICE_INDEX": "1"},
    "st0-idx": {"KKDEPLOY_AOTI_SINGLE_THREADED": "0", "KKDEPLOY_AOTI_DEVICE_INDEX": "1"},
    "st0": {"KKDEPLOY_AOTI_SINGLE_THREADED": "0", "KKDEPLOY_AOTI_DEVICE_INDEX": "0"},
}


def build(shape: int, out: Path) -> None:
    import torch

    from engines import BuildContext, get_backend
    from kkdeploy import official_config
    from kkdeploy.models.weights import build_models

    config = official_config(shape)
    ref, _ = build_models(config, torch.float16, "cuda")
    ctx = BuildContext(config, torch.float16, torch.device("cuda"), ref, out, options={"inductor_cache": False})
    result = get_backend("inductor").build(ctx, "inductor")
    (out / "entry.json").write_text(json.dumps(result.to_dict()))
    # the same graph without the wrappers: does a plain package load here?
    from engines.inductor import ReferenceForward

    x = torch.zeros(config.batch_size, config.seq_len, config.d_model, dtype=torch.float16, device="cuda")
    m = torch.ones(config.batch_size, config.seq_len, dtype=torch.bool, device="cuda")
    exported = torch.export.export(ReferenceForward(ref), (x, m))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(out / "plain.pt2"))


def attempt(shape: int, out: Path, mode: str, cuda_graph: bool) -> dict:
    import torch

    from engines.inductor import InductorRunner
    from kkdeploy import generate_case, official_config
    from kkdeploy.models.weights import build_models

    config = official_config(shape)
    ref, _ = build_models(config, torch.float16, "cuda")
    x, m = generate_case(config, "cuda", torch.float16, 1234)
    with torch.inference_mode():
        expected = ref(x, m)
        if mode == "plain":
            from engines import inductor_ops  # noqa: F401

            model = torch._inductor.aoti_load_package(str(out / "plain.pt2"))
            got = model(x, m)
            got = got[0] if isinstance(got, (list, tuple)) else got
        else:
            runner = InductorRunner(out / "inductor.pt2", config, torch.float16, torch.device("cuda"),
                                    cuda_graph=cuda_graph)
            got = runner(x, m)
    return {"bitwise": bool(torch.equal(expected, got)), "max_abs": float((expected.float() - got.float()).abs().max())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, default=3)
    p.add_argument("--dir")
    p.add_argument("--build", action="store_true")
    p.add_argument("--attempt")
    p.add_argument("--graph", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.build:
        build(args.shape, Path(args.dir))
        return 0
    if args.attempt:
        print("RESULT " + json.dumps(attempt(args.shape, Path(args.dir), args.attempt, bool(args.graph))))
        return 0
    work = Path(args.dir or tempfile.mkdtemp(prefix="aoti-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, __file__, "--build", "--shape", str(args.shape), "--dir", str(work)],
                          capture_output=True, text=True)
    print(f"build: exit {proc.returncode} {proc.stderr[-800:] if proc.returncode else ''}")
    results, best = {}, None
    for mode, graph in [("st1-idx", 1), ("st0-idx", 1), ("st0", 1), ("st0", 0), ("plain", 0)]:
        env = {**os.environ, **MODES.get(mode, {})}
        proc = subprocess.run([sys.executable, __file__, "--attempt", mode, "--graph", str(graph), "--shape",
                               str(args.shape), "--dir", str(work)], capture_output=True, text=True, env=env)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        key = f"{mode}{'' if graph else '-nograph'}"
        results[key] = json.loads(line[7:]) if line else {"exit": proc.returncode, "stderr": proc.stderr[-600:]}
        print(key, json.dumps(results[key]))
        if best is None and line and mode in MODES and results[key]["bitwise"]:
            best = " ".join(f"{k}={v}" for k, v in MODES[mode].items()) + ("" if graph else " KKDEPLOY_AOTI_GRAPH=0")
    (Path(os.environ.get("OUT", ".")) / "inductor_probe.json").write_text(json.dumps(results, indent=2))
    print(f"BEST {best or 'NONE'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
