#!/usr/bin/env python3
"""Serving overhead: Triton (dynamic batching, HTTP or gRPC) against calling ``kkdeploy.load``'s runner directly.

    python scripts/bench_serving.py [--artifacts DIR | --shape N] [--concurrency 1 4 16] [--requests 200]
                                    [--seqs-per-request 1] [--protocol http|grpc] [--out bench-serving]

Without ``--artifacts`` it builds ``--shape`` (default 3) for the CPU first. It then measures
  * direct: the runner in this process, one thread, on full batches of B sequences (the engine's best case) and on
    one sequence padded to B (what serving one sequence per call costs without batching);
  * served: the bundled ``tritonserver`` on ``kkdeploy triton-repo``'s repository, C concurrent clients each sending
    ``--requests`` requests of ``--seqs-per-request`` sequences, every response checked for its shape;
and writes ``serving.json`` (every figure, the environment, the command) and ``serving.md`` (the table) to
``--out``. Latency is per request (per call for direct), wall clock; throughput counts sequences per second over
the whole run. It is a measurement to run by hand, not a test: the clients, the server and the engine share the
machine's cores, which is part of what it measures on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kkdeploy  # noqa: E402
from kkdeploy import artifacts  # noqa: E402
from kkdeploy.cli import main as cli  # noqa: E402
from kkdeploy.config import TransformerConfig, parse_dtype  # noqa: E402
from kkdeploy.serving import triton_repo, triton_server  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summary(latencies_ms: list[float], sequences: int, wall_s: float) -> dict:
    return {"requests": len(latencies_ms), "sequences": sequences, "wall_s": round(wall_s, 3),
            "seq_per_s": round(sequences / wall_s, 1), "req_per_s": round(len(latencies_ms) / wall_s, 1),
            "p50_ms": round(percentile(latencies_ms, 50), 3), "p99_ms": round(percentile(latencies_ms, 99), 3)}


def bench_direct(root: Path, calls: int, warmup: int = 10) -> dict:
    manifest = artifacts.read_json(root / artifacts.MANIFEST)
    runner = kkdeploy.load(root)
    config = TransformerConfig.from_dict(manifest["config"])
    dtype = parse_dtype(manifest["dtype"])
    b, s, d = config.batch_size, config.seq_len, config.d_model
    x = torch.randn(b, s, d, dtype=dtype)
    full = torch.ones(b, s, dtype=torch.bool)
    one = torch.zeros(b, s, dtype=torch.bool)
    one[0] = True
    results = {"backend": runner.backend}
    with torch.inference_mode():
        for name, mask, per_call in (("direct, full batch", full, b), ("direct, 1 sequence padded", one, 1)):
            for _ in range(warmup):
                runner(x, mask)
            times = []
            start = time.perf_counter()
            for _ in range(calls):
                t0 = time.perf_counter()
                runner(x, mask)
                times.append((time.perf_counter() - t0) * 1e3)
            results[name] = summary(times, calls * per_call, time.perf_counter() - start)
    return results


def bench_served(server, info, protocol: str, concurrency: int, requests: int, seqs: int, warmup: int = 5) -> dict:
    lib = __import__(f"tritonclient.{protocol}", fromlist=["InferInput"])
    config = TransformerConfig.from_dict(info.config)
    s, d = config.seq_len, config.d_model
    np_dtype = {"float32": np.float32, "float16": np.float16}[info.dtype]
    x_type = {"float32": "FP32", "float16": "FP16"}[info.dtype]
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    barrier = threading.Barrier(concurrency + 1)

    def client_loop(c: int):
        url = server.http_url if protocol == "http" else server.grpc_url
        client = lib.InferenceServerClient(url, **({"network_timeout": 120.0} if protocol == "http" else {}))
        rng = np.random.default_rng(c)
        x = rng.standard_normal((seqs, s, d)).astype(np_dtype)
        mask = np.ones((seqs, s), dtype=bool)
        inputs = [lib.InferInput("x", [seqs, s, d], x_type), lib.InferInput("valid_token_mask", [seqs, s], "BOOL")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(mask)
        try:
            for _ in range(warmup):
                client.infer(info.model, inputs)
            barrier.wait()
            for _ in range(requests):
                t0 = time.perf_counter()
                y = client.infer(info.model, inputs).as_numpy("y")
                latencies[c].append((time.perf_counter() - t0) * 1e3)
                if y.shape != x.shape:
                    errors.append(f"client {c}: shape {y.shape}")
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            errors.append(f"client {c}: {type(exc).__name__}: {exc}")
            barrier.abort()
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True) for c in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait(timeout=600)
    start = time.perf_counter()
    for t in threads:
        t.join(timeout=1800)
    wall = time.perf_counter() - start
    flat = [v for per in latencies for v in per]
    result = summary(flat, len(flat) * seqs, wall)
    result["errors"] = errors
    return result


def markdown(report: dict) -> str:
    rows = ["| path | clients | seq/request | requests | seq/s | req/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|---|---|---|"]
    direct = report["direct"]
    for name in ("direct, full batch", "direct, 1 sequence padded"):
        r = direct[name]
        per = report["batch_size"] if "full" in name else 1
        rows.append(f"| {name} ({direct['backend']}) | 1 | {per} | {r['requests']} | {r['seq_per_s']} | "
                    f"{r['req_per_s']} | {r['p50_ms']} | {r['p99_ms']} |")
    for r in report["served"]:
        rows.append(f"| Triton {report['protocol']} ({report['engine_backend']} engine) | {r['concurrency']} | "
                    f"{report['seqs_per_request']} | {r['requests']} | {r['seq_per_s']} | {r['req_per_s']} | "
                    f"{r['p50_ms']} | {r['p99_ms']} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", help="artifact directory (default: build --shape for the CPU first)")
    parser.add_argument("--shape", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=200, help="requests per client (default 200)")
    parser.add_argument("--seqs-per-request", type=int, default=1)
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--max-queue-delay-us", type=int, default=0)
    parser.add_argument("--out", default="bench-serving")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    root = Path(args.artifacts) if args.artifacts else work / "artifacts"
    if not args.artifacts:
        assert cli(["build", "--shape", str(args.shape), "--device", "cpu", "--out", str(root)]) == 0
    manifest = artifacts.read_json(root / artifacts.MANIFEST)
    batch = int(manifest["config"]["batch_size"])
    if not 1 <= args.seqs_per_request <= batch:
        parser.error(f"--seqs-per-request must be in 1..{batch}")
    direct = bench_direct(root, calls=max(50, args.requests))
    install = triton_server.find_server() or triton_server.install_server(log=print)
    info = triton_repo.write_repository(root, work / "repository", available_backends=install.backends(),
                                        max_queue_delay_us=args.max_queue_delay_us)
    http, grpc, metrics_port = triton_server.free_ports().values()
    served = []
    with triton_server.TritonServer(install, Path(info.path), work, http_port=http, grpc_port=grpc,
                                    metrics_port=metrics_port) as server:
        server.wait_ready(300)
        for c in args.concurrency:
            r = bench_served(server, info, args.protocol, c, args.requests, args.seqs_per_request)
            r["concurrency"] = c
            served.append(r)
            print(f"{c:>3} clients: {r['seq_per_s']} seq/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
                  + (f", errors: {r['errors'][:2]}" if r["errors"] else ""))
    report = {
        "command": "python3 scripts/bench_serving.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "created": artifacts.utc_now(), "shape_id": manifest.get("shape_id"), "config": manifest["config"],
        "batch_size": batch, "dtype": manifest["dtype"], "candidate": manifest["choice"]["candidate"],
        "engine_backend": info.engine_backend, "engine_reason": info.engine_reason, "protocol": args.protocol,
        "seqs_per_request": args.seqs_per_request, "max_queue_delay_us": args.max_queue_delay_us,
        "requests_per_client": args.requests, "direct": direct, "served": served,
        "environment": {**artifacts.environment(torch.device("cpu")), "cpus": __import__("os").cpu_count(),
                        "platform": platform.platform(), "tritonserver": str(install.binary)},
    }
    artifacts.write_json(out / "serving.json", report)
    table = markdown(report)
    (out / "serving.md").write_text(f"`{report['command']}`\n\n{table}")
    print(table)
    return 0 if not any(r["errors"] for r in served) else 1


if __name__ == "__main__":
    sys.exit(main())
