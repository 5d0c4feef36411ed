"""`kkdeploy loadtest`: load a Triton server from several client processes and check every answer bit for bit
against the direct engine (``kkdeploy.serving.loadtest`` says how and why)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from ..console import console, progress_bar, table
from ..errors import KKError


def register(sub):
    p = sub.add_parser("loadtest", help="closed/open-loop load from several client processes over gRPC and HTTP, "
                                        "every answer checked bit for bit against the direct engine")
    p.add_argument("--artifacts", required=True,
                   help="the artifacts the server serves: the direct engine computes the expected answers from them")
    p.add_argument("--serve", action="store_true",
                   help="start the bundled server on these artifacts for the load (free loopback ports), then stop it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-name", default="kkdeploy")
    p.add_argument("--protocol", default="grpc", help="grpc, http, or both as grpc,http (one run each)")
    p.add_argument("--processes", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="closed loop: clients in all (default 2); open loop: the most requests in flight")
    p.add_argument("--rate", type=float, help="open loop: requests per second in all (default: closed loop)")
    p.add_argument("--arrival", choices=["uniform", "poisson"], default="uniform", help="open-loop arrivals")
    p.add_argument("--requests", type=int, default=1000, help="requests per run (default 1000; 0: use --duration)")
    p.add_argument("--duration", type=float, help="seconds per run (the first of --requests/--duration ends it)")
    p.add_argument("--warmup", type=int, default=5, help="requests per client before the clock (default 5)")
    p.add_argument("--mix", default="1", help="batch sizes and weights, such as 1:0.7,2:0.2,4:0.1 (default 1)")
    p.add_argument("--padding", default="0", help="padding ratios taken in turn, such as 0,0.25 (0: no mask sent)")
    p.add_argument("--pool", type=int, default=64, help="distinct payloads (default 64)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--shared-memory", choices=["none", "system", "cuda"], default="none",
                   help="send inputs and receive outputs through shared memory (cuda needs tritonclient[cuda])")
    p.add_argument("--shm-preload-mb", type=float, default=1024.0,
                   help="with shared memory: write the pool's payloads into each client's input region once, before "
                        "the load, up to this many MB a client (default 1024; 0: each request writes its payload, "
                        "inside the clock)")
    p.add_argument("--no-check", action="store_true", help="do not compute or check the expected answers")
    p.add_argument("--direct", action="store_true",
                   help="also time the engine alone at every bucket (latency, sequences per second)")
    p.add_argument("--device", help="device of the direct engine (default: the artifacts')")
    written = p.add_mutually_exclusive_group()
    written.add_argument("--json", help="write the results here, and their chart beside them (the same name, .png)")
    written.add_argument("--out", help="a folder for the results and their chart (loadtest.json, loadtest.png), as "
                                       "build and bench write theirs")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take (default 60)")
    p.add_argument("--client", choices=["auto", "lean", "native", "tritonclient"], default="auto",
                   help="gRPC: native sends each payload's request, serialized once as perf_analyzer does, through "
                        "kkdeploy's HTTP/2 client in C++ (compiled on first use), without grpcio's Python on every "
                        "call; lean sends the same bytes through grpcio; tritonclient builds and parses every message "
                        "in Python; auto (default): native where it can be built here, else lean. HTTP always uses "
                        "tritonclient")
    from .triton_repo import add_topology_args

    add_topology_args(p)
    p.add_argument("--max-queue-delay-us", type=int, default=0, help="with --serve: the batcher's queue delay")
    p.set_defaults(func=run)


@contextlib.contextmanager
def local_server(args, ports: dict | None = None):
    """The bundled server on ``args.artifacts`` (as ``kkdeploy serve`` runs it), stopped and removed afterwards;
    yields ``(server, info, ports)``. Without ``ports`` it picks free loopback ports, and picks again (3 tries) if
    another process took one between the pick and the server's bind."""
    from ..serving import triton_server
    from ..serving.triton_repo import write_repository

    install = triton_server.locate_server()
    workdir = Path(tempfile.mkdtemp(prefix="kkdeploy-loadtest-"))
    server = None
    try:
        info = write_repository(args.artifacts, workdir / "repository", model_name=args.model_name,
                                engine=args.engine, max_queue_delay_us=args.max_queue_delay_us,
                                available_backends=install.backends(), topology=args.topology,
                                instances=args.instances, served_here=True)
        for attempt in range(1 if ports else 3):
            chosen = dict(ports) if ports else triton_server.free_ports(
                args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1")
            server = triton_server.TritonServer(install, Path(info.path), workdir, address=args.host,
                                                **{f"{k}_port": v for k, v in chosen.items()})
            try:
                server.start()
                server.wait_ready(300)
                break
            except KKError as exc:
                server.stop()
                if ports or attempt == 2 or "already in use" not in str(exc):
                    raise
        console.print(f"server: {info.topology}, buckets {info.buckets}, {info.engine_reason}", soft_wrap=True)
        yield server, info, chosen
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def results_path(args) -> Path | None:
    """Where the results go: ``--out DIR`` (``DIR/loadtest.json``) or ``--json FILE``; checked before any load."""
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise KKError(f"--out {out} is a file; give a folder (loadtest.json and loadtest.png go there)")
        return out / "loadtest.json"
    return Path(args.json) if args.json else None


def run(args) -> int:
    import torch

    import kkdeploy

    from ..pipeline.runtime import bucketed
    from ..serving import loadtest
    from ..serving.triton_repo import read_artifacts

    json_path = results_path(args)
    manifest = read_artifacts(Path(args.artifacts))
    config = manifest["config"]
    protocols = [p.strip() for p in args.protocol.split(",") if p.strip()]
    picked = {protocol: loadtest.pick_client(args.client, protocol) for protocol in protocols}
    for _, note in picked.values():
        if note:
            console.print(note, soft_wrap=True)
    plans = [loadtest.LoadPlan(
        model=args.model_name, seq_len=config["seq_len"], d_model=config["d_model"], dtype=manifest["dtype"],
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        protocol=protocol, processes=args.processes, concurrency=args.concurrency, rate=args.rate,
        arrival=args.arrival, requests=args.requests or None, duration_s=args.duration, warmup=args.warmup,
        mix=loadtest.parse_mix(args.mix), padding=loadtest.parse_ratios(args.padding), pool=args.pool,
        seed=args.seed, shared_memory=args.shared_memory, preload_mb=args.shm_preload_mb, timeout_s=args.timeout,
        client=picked[protocol][0])
        for protocol in protocols]
    for plan in plans:
        plan.check()
    for hint in dict.fromkeys(filter(None, (loadtest.payload_hint(plan) for plan in plans))):
        console.print(f"[dim]{hint}[/]", soft_wrap=True)
    buckets = [b["batch"] for b in (manifest.get("batch_buckets") or {}).get("buckets", [])] or [config["batch_size"]]
    largest = max(n for n, _ in plans[0].mix)
    if largest > max(buckets):
        raise KKError(f"--mix asks for {largest} sequences per request; the artifacts serve at most {max(buckets)}")
    runner = None
    answers = None
    direct = None
    if not args.no_check or args.direct:
        device = args.device or manifest["environment"]["device"]["type"]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise KKError(f"{args.artifacts} was built for CUDA; run the load test's direct engine on that GPU "
                          f"(or --no-check without --direct)")
        runner = bucketed(kkdeploy.load(args.artifacts, device=device))
    if not args.no_check:
        with progress_bar("expected answers (direct engine)", 1) as bar:
            answers = loadtest.expected_answers(runner, loadtest.make_pool(plans[0]))
            bar.advance()
    if args.direct:
        direct = loadtest.direct_engine(runner)
    results = []
    with (local_server(args) if args.serve else contextlib.nullcontext()) as served:
        for plan in plans:
            if served is not None:
                ports = served[2]
                plan.http_port, plan.grpc_port, plan.metrics_port = ports["http"], ports["grpc"], ports["metrics"]
            with progress_bar(f"load {plan.protocol} {plan.loop} loop", plan.processes) as bar:
                summary = loadtest.run_load(plan, answers, progress=lambda n: bar.advance())
            results.append(summary)
    if direct:
        for summary in results:
            summary["against_engine"] = loadtest.against_engine(summary, {str(k): v for k, v in direct.items()})
    print_results(results, direct)
    data = {"artifacts": str(Path(args.artifacts).resolve()), "buckets": buckets, "direct_engine": direct,
            "runs": results, "perf_analyzer_equivalent": [loadtest.perf_analyzer_command(p) for p in plans]}
    if json_path is not None:
        from .. import artifacts

        from ..serving.loadtest_chart import plot_load

        json_path.parent.mkdir(parents=True, exist_ok=True)
        artifacts.write_json(json_path, data)
        chart = plot_load(json_path.with_suffix(".png"), results, direct)
        console.print(f"results: {json_path}; chart: {chart}")
    bad = sum(r["wrong"] + r["errors"] + r["warmup_wrong"] for r in results)
    if bad:
        total = sum(r["requests"] for r in results)
        first = next((r["first_errors"][0] for r in results if r["first_errors"]), "")
        raise_line = (f"{bad} of {total} requests failed or differ from the direct engine"
                      + (f" (first error: {first})" if first else ""))
        console.print(f"[bold red]FAILED:[/] {raise_line}", soft_wrap=True)
        return 1
    return 0


def print_results(results: list[dict], direct: dict | None) -> None:
    if direct:
        console.print(table("Direct engine (in this process, one full bucket per call)", ["bucket", "median ms",
                                                                                        "seq/s"],
                            [[b, v["median_ms"], v["seq_per_s"]] for b, v in direct.items()]))
    rows = []
    for r in results:
        plan = r["plan"]
        load = f"c={plan['concurrency']}" if r["loop"] == "closed" else f"{plan['rate']}/s"
        lat = r["latency_ms"]
        rows.append([plan["protocol"], f"{r['loop']} {load}", plan["processes"], r["answered"], r["errors"],
                     "-" if not r["checked"] else f"{r['bitwise_equal']}/{r['answered']}", r["req_per_s"],
                     r["seq_per_s"], lat["p50"], lat["p90"], lat["p99"]])
    breakdown = []
    for r in results:
        s, lat = r["server"], r["latency_ms"]
        per_request = s.get("request_duration_us_per_request")
        client = lat["mean"]
        breakdown.append([r["plan"]["protocol"], client, _ms(per_request),
                          _ms(None if per_request is None or client is None else client * 1000 - per_request),
                          r.get("rpc_floor_ms"),
                          _ms(s.get("queue_duration_us_per_request")), _ms(s.get("compute_input_duration_us_per_request")),
                          _ms(s.get("compute_infer_duration_us_per_request")),
                          _ms(s.get("compute_output_duration_us_per_request")), _ms(s.get("gather_us_per_run")),
                          _ms(s.get("engine_us_per_run")), _ms(s.get("respond_us_per_run")),
                          s.get("avg_batch_sequences"), s.get("padding_rows_fraction")])
    console.print(table("Where the time goes, ms: per request (client; Triton: server, queue, input, infer, output; "
                        "rpc floor: an empty gRPC call's p50) and per engine run (kkdeploy: gather, engine, respond)",
                        ["proto", "client", "server", "net", "rpc floor", "queue", "input", "infer", "output", "gather",
                         "engine", "respond", "seq/run", "pad"], breakdown))
    console.print(table("Load (every answer checked bit for bit against the direct engine)",
                        ["protocol", "loop", "procs", "answered", "errors", "bitwise", "req/s", "seq/s", "p50 ms",
                         "p90 ms", "p99 ms"], rows))
    if direct:
        against = []
        for r in results:
            a = r["against_engine"]
            over = a.get("p50_over_engine_ms")
            against.append([r["plan"]["protocol"], f"{100 * a['fraction_of_engine']:.1f}%" if a["fraction_of_engine"]
                            else "-", a["largest_bucket"], "-" if over is None else f"{over:+.3f}",
                            "-" if over is None else f"{a['engine_ms']} (bucket {a['bucket']})"])
        console.print(table("Against the engine alone", ["protocol", "seq/s, % of the engine's", "at bucket",
                                                         "p50 - engine ms", "engine ms"], against))


def _ms(us):
    return None if us is None else round(us / 1000, 3)
