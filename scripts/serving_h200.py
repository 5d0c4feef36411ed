"""Issues 30 and 33, measured: builds with batch buckets, the engine alone, the server before (two hops) and after
(one hop) under the same load generator, every answer checked bit for bit, and the watchdog and stop on a real
fault. Run by scripts/serving_h200.sh on the H200 (one device call); runs on the CPU too (--device cpu --quick) as
a dry run of the whole path.

    python3 scripts/serving_h200.py --out OUT [--device cuda] [--budget 480] [--only 3,faults,faults-gpu,6,13] [--quick]
        [--instances 4,2] [--variants copies,direct,native,native+spin] [--no-before] [--fault-instances 1] [--build-only]

Steps, in order of importance, each skipped (and said so) when the remaining budget is too small:
  shape 3 (FP16 strict, weights of our own, buckets 1,2,4): direct engine; one hop: batch-1 gRPC c=1 (p50 against
    the engine's bucket-1 latency + 0.4 ms), saturation with full-bucket requests (against the engine's throughput
    at bucket 4) and with batch-1 requests, 12,000 mixed requests (batch 1-4, padding 0/0.25/0.5) checked bit for
    bit, the same batch-1 run through system shared memory (all with answers in host memory, the default); the
    saturation runs again with 4 and 2 model instances; before (unless --no-before): the same batch-1 and saturation runs with GPU
    outputs (``--output-device gpu``), then with two hops;
  faults (issue 33) on the shape-3 artifact: `kkdeploy serve` under gRPC load, kill -9 of the stub (time to not-ready,
    to healed, wrong answers and when), then SIGINT under load (stop time, exit code, processes left); faults-gpu:
    the same with GPU outputs, the layout in which a wrong answer was seen;
  shape 6 (buckets 1 and 10000): batch-1 gRPC latency (target: p50 <= 5 ms);
  shape 13 (buckets 1,8,64): batch-1 latency, saturation at bucket 64, mixed requests; batch-1 and saturation
    through system shared memory; the saturation runs again with --instances.
Writes OUT/serving-h200.json and prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = {"3": 200, "6": 100, "13": 120, "faults": 60, "faults-gpu": 60, "faults-inprocess": 60}  # seconds each needs
FAULT_STEPS = ("faults", "faults-gpu", "faults-inprocess")  # on shape 3's artifact: the stub (or the server) killed


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def own_weights(path: Path, seed: int = 4711) -> Path:
    """Weights the project never saw (scripts/make_weights.py's trained-like weights, another seed); shapes 3, 6 and
    13 share D=128 H=4 F=128 L=4, so one file serves all three."""
    import importlib.util

    from safetensors.torch import save_file

    from kkdeploy import official_config

    spec = importlib.util.spec_from_file_location("make_weights", Path(__file__).with_name("make_weights.py"))
    make_weights = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_weights)
    save_file(make_weights.trained_like(official_config(3), seed), str(path))
    return path


def build(shape: str, buckets: str, args, work: Path, weights: Path | None, timeout_s: float) -> Path | None:
    out = work / f"shape-{shape}"
    cmd = [sys.executable, "-m", "kkdeploy", "build", *(["--shape", shape] if not args.quick else
                                                        ["--batch-size", str(QUICK_B[shape]), "--seq-len", "32",
                                                         "--d-model", "32", "--heads", "2", "--ffn-dim", "32",
                                                         "--layers", "2"]),
           "--device", args.device, "--batch-buckets", buckets, "--out", str(out), "--force",
           "--warmups", "5", "--repeats", "30", "--rounds", "1"]
    if args.device != "cpu":
        cmd += ["--dtype", "float16", "--backends", args.backends]
    if weights is not None and not args.quick:
        cmd += ["--weights", str(weights)]
    if args.quick:
        cmd += ["--trials", "2"]
    log(f"build shape {shape} buckets {buckets}: {' '.join(cmd[3:])}")
    began = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"build shape {shape}: not done in {timeout_s:.0f} s")
        return None
    tail = "\n".join(done.stdout.splitlines()[-14:])
    log(f"build shape {shape}: exit {done.returncode} in {time.monotonic() - began:.0f} s\n{tail}\n{done.stderr[-800:]}")
    return out if done.returncode == 0 else None


QUICK_B = {"3": 4, "6": 16, "13": 8}


class Server:
    """The bundled server on one artifact and topology, on free loopback ports."""

    def __init__(self, artifacts: Path, topology: str, engine: str = "auto", delay_us: int = 0,
                 output_device: str = "cpu", instances: int = 1):
        from kkdeploy.serving import triton_repo, triton_server

        self.work = Path(tempfile.mkdtemp(prefix="kk-h200-"))
        install = triton_server.locate_server()
        self.info = triton_repo.write_repository(artifacts, self.work / "repository", engine=engine,
                                                 topology=topology, available_backends=install.backends(),
                                                 max_queue_delay_us=delay_us, output_device=output_device,
                                                 instances=instances)
        self.label = (self.info.topology + (", in-process" if self.info.engine_backend == "kkdeploy" else "")
                      + ("" if self.info.output_device == "cpu" else ", GPU outputs")
                      + ("" if instances == 1 else f", {instances} instances"))
        self.ports = triton_server.free_ports()
        self.server = triton_server.TritonServer(install, Path(self.info.path), self.work, exit_timeout_s=2,
                                                 **{f"{k}_port": v for k, v in self.ports.items()})

    def __enter__(self):
        began = time.monotonic()
        self.server.start()
        self.server.wait_ready(400)
        log(f"server {self.label} ready in {time.monotonic() - began:.0f} s")
        self.instances = [ln.strip() for ln in self.server.log_text().splitlines() if "in-process on" in ln]
        for line in self.instances:  # each in-process instance's line: its device, buckets, host-wait mode
            log(f"  {line[:400]}")
        return self

    def __exit__(self, *exc):
        self.server.stop(timeout_s=5)
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)


def run_plan(server: Server, runner, name: str, **kw) -> dict:
    from kkdeploy.serving import loadtest

    cfg = server.info.config
    plan = loadtest.LoadPlan(model=server.info.model, seq_len=cfg["seq_len"], d_model=cfg["d_model"],
                             dtype=server.info.dtype, http_port=server.ports["http"], grpc_port=server.ports["grpc"],
                             metrics_port=server.ports["metrics"], **kw)
    answers = loadtest.expected_answers(runner, loadtest.make_pool(plan))
    summary = loadtest.run_load(plan, answers)
    summary["name"] = name
    summary["topology"] = server.label
    summary["instance_lines"] = server.instances
    lat = summary["latency_ms"]
    log(f"{name} [{server.label}]: {summary['answered']}/{summary['requests']} answered, "
        f"{summary['bitwise_equal']} bitwise, {summary['errors']} errors, {summary['req_per_s']} req/s, "
        f"{summary['seq_per_s']} seq/s, p50 {lat['p50']} p90 {lat['p90']} p99 {lat['p99']} ms; "
        f"server {json.dumps(summary['server'])}")
    return summary


def cuda_shared_memory_missing() -> str:
    """Why tritonclient's CUDA shared memory cannot be used here ("" when it can)."""
    try:
        import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or its own RuntimeError without cuda-bindings
        return f"tritonclient's CUDA shared memory cannot be imported: {type(exc).__name__}: {str(exc)[:200]}"
    return ""


def variants_of(engine: str, args) -> list[tuple[str, str]]:
    """``(route, host-wait mode)`` of each ``--variants`` entry for the in-process backend (route: native, direct or
    copies; the mode it sets on tritonserver's CUDA context); the Python backend's own."""
    return args.variants if engine == "inprocess" else [("native", "leave")]


#: a route's environment for the in-process instances: (KKDEPLOY_DIRECT_ROUTE, KKDEPLOY_NATIVE_ROUTE)
ROUTE_ENV = {"native": ("1", "1"), "direct": ("1", "0"), "copies": ("0", "0")}


def measures_all(label: str) -> bool:
    """Whether a layout runs every plan (its mixed run checks its answers): the one-hop layouts, in-process or not,
    whatever their variant (static inputs, route, host-wait mode, instances: more instances then run every saturation
    plan, shared memory included); the layouts before them run the batch-1 and saturation plans only."""
    variant = r", (static inputs|host waits [^,]+|torch copies|direct route in Python|\d+ instances)"
    return re.sub(variant, "", label) in ("one-hop", "one-hop, in-process")


def measure_shape(shape: str, artifacts: Path, args, deadline: float) -> dict:
    import kkdeploy
    from kkdeploy.pipeline.runtime import bucketed
    from kkdeploy.serving import loadtest
    from kkdeploy.serving.cuda_driver import HOST_WAIT_ENV
    from kkdeploy.serving.inprocess import DIRECT_ROUTE_ENV, NATIVE_ROUTE_ENV
    from kkdeploy.serving.triton_model import STATIC_INPUTS_ENV

    runner = bucketed(kkdeploy.load(artifacts, device=args.device))
    result = {"buckets": runner.sizes, "backends": {str(b): r.backend for b, r in runner.buckets.items()},
              "direct": loadtest.direct_engine(runner), "runs": []}
    log(f"shape {shape} direct engine: {result['direct']} ({result['backends']})")
    big = runner.sizes[-1]
    n = (lambda full: max(200, full // 20)) if args.quick else (lambda full: full)
    cfg = runner.config
    row_bytes = cfg.seq_len * cfg.d_model * (2 if args.device != "cpu" else 4)
    # 64 clients for small requests; fewer when one request is megabytes (the Python backend's /dev/shm pool holds
    # a whole gathered batch, in and out)
    sat_conc = 8 if args.quick or row_bytes * min(big, 64) > (1 << 20) else 64
    if shape == "6":
        plans = [("batch-1 c=1", dict(processes=1, concurrency=1, requests=n(1000), mix=[[1, 1.0]], pool=16))]
        layouts = [("one-hop", "cpu", 1, engine, static, variant) for engine in args.engines for static in args.static
                   for variant in variants_of(engine, args)]
    else:
        full = min(big, 64)
        plans = [
            ("batch-1 c=1", dict(processes=1, concurrency=1, requests=n(3000), mix=[[1, 1.0]], pool=64)),
            (f"saturation, batch-{full} requests", dict(processes=4, concurrency=sat_conc, requests=n(8000 if big <= 8 else 2000),
                                                       mix=[[full, 1.0]], pool=16)),
            ("saturation, batch-1 requests", dict(processes=4, concurrency=sat_conc, requests=n(20000),
                                                  mix=[[1, 1.0]], pool=64)),
            ("mixed, padded", dict(processes=4, concurrency=16, requests=n(12000 if shape == "3" else 10000),
                                   mix=[[b, w] for b, w in ((1, 0.5), (2, 0.2), (3, 0.15), (big, 0.15)) if b <= big],
                                   padding=[0.0, 0.25, 0.5], pool=256)),
        ]
        if shape in ("3", "13"):
            plans.append(("batch-1 c=1, system shared memory", dict(processes=1, concurrency=1, requests=n(2000),
                                                                   mix=[[1, 1.0]], pool=16, shared_memory="system")))
        if shape == "13":  # a 16 MB request is Triton's gRPC frontend's work; through shared memory it is not
            plans.append((f"saturation, batch-{full} requests, system shared memory",
                          dict(processes=4, concurrency=sat_conc, requests=n(2000), mix=[[full, 1.0]], pool=16,
                               shared_memory="system")))
            missing = cuda_shared_memory_missing() if args.device != "cpu" else "a CPU artifact"
            if missing:
                result["runs"].append({"name": "CUDA shared memory", "skipped": missing})
            else:  # the client's regions on the GPU: the requests reach the instance in GPU memory
                plans.append(("batch-1 c=1, CUDA shared memory", dict(processes=1, concurrency=1, requests=n(2000),
                                                                      mix=[[1, 1.0]], pool=16, shared_memory="cuda")))
                plans.append((f"saturation, batch-{full} requests, CUDA shared memory",
                              dict(processes=4, concurrency=sat_conc, requests=n(2000), mix=[[full, 1.0]], pool=16,
                                   shared_memory="cuda")))
        # one hop with host outputs (the default); then its saturation with 4 and 2 model instances (one stub's
        # Python work per execute, ~0.5 ms on the H200, is what bounds one instance, not the GPU); then the layouts
        # before it: GPU outputs, two hops
        # (topology, output device, instances, engine): each --engines one-hop engine (kkdeploy's in-process
        # backend, the Python backend), then the layouts before them
        layouts = [("one-hop", "cpu", 1, engine, static, variant) for engine in args.engines for static in args.static
                   for variant in variants_of(engine, args)]
        # more instances: shape 3's bound is one instance's host work per run; shape 13's is its host copies (16 MB
        # each way per batch of 64), which other instances overlap with the engine
        layouts += [("one-hop", "cpu", n, engine, static, variant) for engine in args.engines for n in args.instances
                    if n > 1 for static in args.static for variant in variants_of(engine, args)]
        if shape == "3":
            if args.before:
                if args.device != "cpu":  # a CPU artifact's answers are in host memory either way
                    layouts.append(("one-hop", "gpu", 1, "auto", args.static[0], ("native", "leave")))
                layouts.append(("two-hop", "cpu", 1, "python", args.static[0], ("native", "leave")))
    for layout, outputs, instances, engine, static, (route, wait) in layouts:
        direct, native = ROUTE_ENV[route]
        if time.monotonic() > deadline:
            result["runs"].append({"skipped": f"{layout}, {outputs} outputs, {instances} instances: out of budget"})
            continue
        server = None
        before = {k: os.environ.get(k) for k in (STATIC_INPUTS_ENV, HOST_WAIT_ENV, DIRECT_ROUTE_ENV, NATIVE_ROUTE_ENV)}
        os.environ[STATIC_INPUTS_ENV] = static  # the server inherits it as it starts (BucketEngine reads it)
        os.environ[DIRECT_ROUTE_ENV] = direct  # the in-process instances read these three
        os.environ[NATIVE_ROUTE_ENV] = native
        os.environ[HOST_WAIT_ENV] = wait  # (set on the server's context)
        try:
            server = Server(artifacts, layout, engine=engine, output_device=outputs, instances=instances)
            if engine == "inprocess" and route == "copies":
                server.label += ", torch copies"
            if engine == "inprocess" and route == "direct":
                server.label += ", direct route in Python"
            if wait != "leave":
                server.label += f", host waits {wait}"
            if static == "1":
                server.label += ", static inputs"
            server.__enter__()
        except Exception as exc:  # noqa: BLE001 - e.g. the in-process backend cannot be built or load here
            result["runs"].append({"skipped": f"{layout}, engine {engine}: {type(exc).__name__}: {str(exc)[:300]}"})
            log(f"shape {shape}: {result['runs'][-1]['skipped']}")
            if server is not None:
                server.__exit__(None, None, None)
            continue  # the other layouts still run
        finally:  # the models have loaded (or failed to): later steps start servers with the default again
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            for name, kw in plans:
                if not measures_all(server.label) and ("mixed" in name or "shared" in name):
                    continue  # before/after compares the batch-1 and saturation runs
                if instances > 1 and "saturation" not in name:
                    continue  # more instances are for throughput
                if time.monotonic() > deadline:
                    result["runs"].append({"name": name, "topology": server.label, "skipped": "out of budget"})
                    continue
                for client in args.clients[:1] if "mixed" in name else args.clients:
                    label = name if len(args.clients) == 1 else f"{name}, {client} client"
                    if time.monotonic() > deadline:
                        result["runs"].append({"name": label, "topology": server.label, "skipped": "out of budget"})
                        continue
                    try:
                        result["runs"].append(run_plan(server, runner, label, protocol="grpc", warmup=20,
                                                       client=client, **kw))
                    except Exception as exc:  # noqa: BLE001 - one plan that cannot run leaves the others theirs
                        result["runs"].append({"name": label, "topology": server.label,
                                               "skipped": f"failed: {type(exc).__name__}: {str(exc)[:300]}"})
                        log(f"{label} [{server.label}]: {result['runs'][-1]['skipped']}")
        finally:
            server.__exit__(None, None, None)
    return result


def faults(artifacts: Path, args, output_device: str = "cpu", engine: str = "auto") -> dict:
    """Issue 33 on this machine: kill -9 of the stub under gRPC load, then SIGINT under load. Every wrong answer is
    recorded with its time from the kill (a wrong answer is never allowed; ``output_device`` gpu reproduces the
    layout in which one was seen). ``engine`` inprocess: the engine runs inside tritonserver, which has no stub, so
    the server itself is killed (a crash in the engine looks like that) and the watchdog restarts it."""
    import kkdeploy
    from kkdeploy.serving import loadtest, triton_server

    ports = triton_server.free_ports()
    http, grpc, metrics = ports["http"], ports["grpc"], ports["metrics"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kkdeploy", "serve", "--artifacts", str(artifacts),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                             "--probe-interval", "2", "--output-device", output_device,
                             "--instances", str(args.fault_instances), "--engine", engine],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []
    threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in iter(proc.stdout.readline, "")],
                     daemon=True).start()
    out: dict = {}

    def seen(pattern, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end and proc.poll() is None:
            hit = next((t for t, ln in lines if re.search(pattern, ln)), None)
            if hit:
                return hit
            time.sleep(0.05)
        return next((t for t, ln in lines if re.search(pattern, ln)), None)

    try:
        if not seen(r"^ready in", 400):
            out["error"] = "serve not ready: " + "".join(ln for _, ln in lines)[-1500:]
            return out
        cfg = json.loads((artifacts / "manifest.json").read_text())["config"]
        dtype = json.loads((artifacts / "manifest.json").read_text())["dtype"]
        plan = loadtest.LoadPlan(model="kkdeploy", seq_len=cfg["seq_len"], d_model=cfg["d_model"], dtype=dtype,
                                 grpc_port=grpc, http_port=http, mix=[[1, 1.0], [2, 1.0]], pool=16, timeout_s=20)
        pool = loadtest.make_pool(plan)
        answers = loadtest.expected_answers(kkdeploy.load(artifacts, device=args.device), pool)
        events, ready, stop = [], [], threading.Event()

        def client(seed):
            c = loadtest.Client(plan, pool, {}, f"f{seed}")
            import random

            pick = random.Random(seed)
            while not stop.is_set():
                k = pick.randrange(len(pool))
                try:
                    events.append((time.monotonic(), "ok" if loadtest.answered_by(answers[k], c.send(k)) is not None
                                   else "wrong"))
                except Exception:  # noqa: BLE001
                    events.append((time.monotonic(), "error"))
                    time.sleep(0.02)
            c.close()

        def poll():
            import urllib.error
            import urllib.request

            while not stop.is_set():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
                        ready.append((time.monotonic(), r.status))
                except urllib.error.HTTPError as e:
                    ready.append((time.monotonic(), e.code))
                except OSError:
                    ready.append((time.monotonic(), None))
                time.sleep(0.1)

        threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in (1, 2)]
        threads.append(threading.Thread(target=poll, daemon=True))
        for t in threads:
            t.start()
        time.sleep(3)
        workdir = re.search(r"repository (\S+)/repository", "".join(ln for _, ln in lines)).group(1)
        if engine == "inprocess":
            victim = int(re.search(r"tritonserver pid (\d+)", "".join(ln for _, ln in lines)).group(1))
        else:
            victim = next(pid for pid, _, st, cmd in triton_server._process_table()
                          if "triton_python_backend_stub" in cmd and workdir in cmd and st != "Z")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        healed = seen(r"watchdog: .* healed in", 60)
        time.sleep(2)
        not_ready = next((t for t, s in ready if t >= killed and s != 200), None)
        out["kill9"] = {
            "not_ready_after_s": None if not_ready is None else round(not_ready - killed, 2),
            "healed_after_s": None if healed is None else round(healed - killed, 2),
            "wrong_answers": sum(1 for _, k in events if k == "wrong"),
            "wrong_at_s_from_kill": [round(t - killed, 3) for t, k in events if k == "wrong"],
            "answered_ok_before_kill": sum(1 for t, k in events if k == "ok" and t < killed),
            "errors_during": sum(1 for t, k in events if k == "error" and t >= killed),
            "correct_after_heal": sum(1 for t, k in events if k == "ok" and healed and t > healed),
            "lines": [ln.strip() for _, ln in lines if "watchdog" in ln],
            "stubs_after_heal": sum(1 for _, _, st, cmd in triton_server._process_table()
                                    if "triton_python_backend_stub" in cmd and workdir in cmd and st != "Z")}
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        out["sigint_under_load"] = {"stop_s": round(time.monotonic() - began, 2), "exit_code": code,
                                    "left": triton_server.processes_mentioning(workdir),
                                    "lines": [ln.strip() for _, ln in lines if "stop" in ln]}
        out["wrong_answers_total"] = sum(1 for _, k in events if k == "wrong")
        out["output_device"] = output_device
        out["instances"] = args.fault_instances
        out["engine"] = engine
        out["killed"] = "tritonserver" if engine == "inprocess" else "stub"
        log(f"faults: {json.dumps(out)}")
        return out
    finally:
        if proc.poll() is None:
            proc.kill()


def table(results: dict) -> str:
    rows = ["| shape | topology | run | answered | bitwise | req/s | seq/s | p50 ms | p99 ms | engine ms (bucket) | "
            "engine seq/s (largest) | executions by route |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, res in results.get("shapes", {}).items():
        if "error" in res:
            rows.append(f"| {shape} | - | {res['error']} | | | | | | | | | |")
            continue
        direct = res["direct"]
        largest = str(res["buckets"][-1])
        for run in res["runs"]:
            if "skipped" in run:
                rows.append(f"| {shape} | {run.get('topology', '-')} | {run.get('name', '')} skipped: "
                            f"{run['skipped']} | | | | | | | | | |")
                continue
            sizes = sorted({int(n) for n, _ in run["plan"]["mix"]})
            bucket = str(next(b for b in res["buckets"] if b >= sizes[-1]))
            lat = run["latency_ms"]
            routes = ", ".join(f"{k} {int(v)}" for k, v in (run.get("server") or {}).get("executions_by_route",
                                                                                         {}).items()) or "-"
            rows.append(f"| {shape} | {run['topology']} | {run['name']} | {run['answered']}/{run['requests']} | "
                        f"{run['bitwise_equal']} | {run['req_per_s']} | {run['seq_per_s']} | {lat['p50']} | "
                        f"{lat['p99']} | {direct[bucket]['median_ms']} ({bucket}) | {direct[largest]['seq_per_s']} | "
                        f"{routes} |")
    for step in FAULT_STEPS:
        f = results.get(step) or {}
        if f.get("kill9"):
            k, s = f["kill9"], f["sigint_under_load"]
            rows.append("")
            rows.append(f"{step} ({f.get('output_device', 'cpu')} outputs): kill -9 {f.get('killed', 'stub')} -> "
                        f"not ready after "
                        f"{k['not_ready_after_s']} s, healed after {k['healed_after_s']} s, wrong answers "
                        f"{f['wrong_answers_total']} (at {k.get('wrong_at_s_from_kill')} s from the kill); SIGINT "
                        f"under load -> stopped in {s['stop_s']} s, exit {s['exit_code']}, left {s['left']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    p.add_argument("--only", default="3,faults,faults-gpu,6,13")
    p.add_argument("--backends", default="torch-compile-faithful-gemms,torch-graph")
    p.add_argument("--quick", action="store_true", help="a small custom shape instead of the official ones (CPU)")
    p.add_argument("--instances", default="4,2",
                   help="model instance counts for shape 3's extra saturation runs (default 4,2)")
    p.add_argument("--engines", default="inprocess,auto",
                   help="one-hop engines to measure side by side: inprocess (kkdeploy's backend in tritonserver's "
                        "process), auto (the Python backend) (default inprocess,auto)")
    p.add_argument("--static-inputs", default="on", choices=["on", "off", "both"],
                   help="one-hop engines write requests straight into a captured graph's buffers as kkdeploy serve "
                        "does by default (on), or copy them into the engine (off), or each one-hop layout twice, on "
                        "then off, for a before/after in one session (both)")
    p.add_argument("--variants", default="native",
                   help="the in-process backend's variants, each served in turn: its route, native (the default: the "
                        "C++ half serves what it can by itself), direct (Python's direct route) or copies (torch's), "
                        "and optionally +MODE, the host-wait mode it sets on the server's CUDA context (auto, spin, "
                        "yield, blocking-sync; default: the server's own). E.g. copies,direct,native,native+spin")
    p.add_argument("--client", default="lean",
                   help="the load test's gRPC clients, comma-separated: lean (default: requests serialized once per "
                        "payload, sent by grpcio), native (the same bytes through kkdeploy's HTTP/2 client in C++), "
                        "tritonclient. With several, every plan but the mixed one runs once per client, in turn, "
                        "on the same server")
    p.add_argument("--no-before", dest="before", action="store_false",
                   help="skip the layouts before (GPU outputs, two hops)")
    p.add_argument("--fault-instances", type=int, default=1,
                   help="model instances of the served artifact in the fault runs (default 1)")
    p.add_argument("--build-only", action="store_true",
                   help="build the shapes without measuring them (for the fault runs alone)")
    args = p.parse_args(argv)
    args.instances = [int(n) for n in args.instances.split(",") if n.strip()]
    args.clients = [c.strip() for c in args.client.split(",") if c.strip()]
    if not args.clients or any(c not in ("lean", "native", "tritonclient") for c in args.clients):
        p.error(f"--client {args.client!r}: lean, native or tritonclient, comma-separated")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.static = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.static_inputs]
    from kkdeploy.serving.cuda_driver import host_wait_wanted

    asked, args.variants = args.variants, []
    for variant in filter(None, (v.strip() for v in asked.split(","))):
        route, _, wait = variant.partition("+")
        if route not in ROUTE_ENV:
            p.error(f"--variants {variant!r}: the route is native, direct or copies")
        try:
            host_wait_wanted(wait or "leave")
        except ValueError as exc:
            p.error(f"--variants {variant!r}: " + str(exc).split(" is ", 1)[1])
        args.variants.append((route, wait or "leave"))
    started = time.monotonic()
    deadline = started + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kk-serving-h200-"))
    only = [s.strip() for s in args.only.split(",")]
    results: dict = {"device": args.device, "shapes": {}, "skipped": []}
    try:
        import torch

        results["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        results["torch"] = torch.__version__
        weights = own_weights(work / "weights.safetensors")
        buckets = {"3": "1,2,4", "6": "1", "13": "1,8,64"} if not args.quick else {"3": "1,2,4", "6": "1", "13": "1,8"}
        artifacts = {}
        for step in only:
            left = deadline - time.monotonic()
            need = 60 if args.build_only and step not in FAULT_STEPS else STEPS.get(step, 60)
            if left < need:
                results["skipped"].append(f"{step}: {left:.0f} s left")
                log(f"skip {step}: {left:.0f} s left")
                continue
            if step in FAULT_STEPS:
                if "3" in artifacts:
                    results[step] = faults(artifacts["3"], args, "gpu" if step == "faults-gpu" else "cpu",
                                           "inprocess" if step == "faults-inprocess" else "auto")
                continue
            built = build(step, buckets[step], args, work, weights, timeout_s=min(left - 30, 300))
            if built is None:
                results["shapes"][step] = {"error": "build failed or timed out"}
                continue
            artifacts[step] = built
            manifest = json.loads((built / "manifest.json").read_text())
            results.setdefault("builds", {})[step] = manifest.get("batch_buckets") or manifest["choice"]
            try:
                later = only[only.index(step) + 1:]  # the fault runs need this artifact: keep their time
                reserve = sum(STEPS[f] for f in FAULT_STEPS if f in later) if step == "3" else 0
                if not args.build_only:
                    results["shapes"][step] = measure_shape(step, built, args, deadline - 20 - reserve)
            except Exception as exc:  # noqa: BLE001 - the next step still runs
                results["shapes"][step] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                log(f"shape {step}: {results['shapes'][step]['error']}")
    finally:
        results["seconds"] = round(time.monotonic() - started, 1)
        (out / "serving-h200.json").write_text(json.dumps(results, indent=1, default=str))
        charts(out, results)
        print("\n" + table(results), flush=True)
    return 0


def charts(out: Path, results: dict) -> None:
    """``serving-h200-<shape>-<n>.png``: ``kkdeploy loadtest``'s chart of each shape's measured runs, one per server
    layout (the runs of one layout are comparable; the engine alone from the same shape as the dashed line)."""
    from kkdeploy.serving.loadtest_chart import plot_load

    for shape, measured in results.get("shapes", {}).items():
        runs = [r for r in measured.get("runs", []) if "skipped" not in r]
        layouts = list(dict.fromkeys(r["topology"] for r in runs))
        for n, layout in enumerate(layouts, 1):
            try:
                plot_load(out / f"serving-h200-{shape}-{n}.png", [r for r in runs if r["topology"] == layout],
                          measured.get("direct"))
            except Exception as exc:  # noqa: BLE001 - a chart must not cost the measurements
                log(f"chart of shape {shape}, {layout}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
