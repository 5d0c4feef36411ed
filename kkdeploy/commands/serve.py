"""`kkdeploy serve --artifacts DIR`: run Triton Inference Server on the artifacts until interrupted.

The repository is written to a temporary directory (removed at exit) and served by the ``tritonserver`` that
``kkdeploy.serving.triton_server`` finds; ``--install-server`` installs the one bundled in nvidia-pytriton.

Issue 33: "ready" is printed only once the server answering on our ports is the one this process started (its
process alive, a per-run token in its model config) and a canary request got the validated answer; a watchdog
(``serving.watchdog``) then heals a broken model or exits 3; Ctrl-C or SIGTERM unloads the models (readiness false,
in-flight requests drain up to ``--drain-timeout``), stops the server and every process it started within about
5 s, and exits 0 only if that stop was clean (1 otherwise). Setup errors exit 2.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path

from ..console import console, err_console
from ..errors import KKError

EXIT_UNCLEAN_STOP = 1
SERVER_EXIT_TIMEOUT_S = 1  # tritonserver's --exit-timeout-secs: models are already unloaded when it gets SIGTERM


def register(sub):
    from ..serving.triton_server import DEFAULT_PORTS
    from .triton_repo import add_topology_args

    p = sub.add_parser("serve", help="serve artifacts on Triton Inference Server (HTTP, gRPC, metrics)")
    p.add_argument("--artifacts", help="artifact directory written by `kkdeploy build`")
    for name, port in DEFAULT_PORTS.items():
        p.add_argument(f"--{name}-port", type=int, default=port, help=f"default {port}")
    p.add_argument("--address", default="127.0.0.1",
                   help="address the endpoints listen on (default 127.0.0.1; 0.0.0.0 to serve other machines)")
    p.add_argument("--model-name", default="kkdeploy", help="model name clients call (default kkdeploy)")
    add_topology_args(p)
    p.add_argument("--max-queue-delay-us", type=int, default=0,
                   help="dynamic batcher: how long a request may wait to fill a batch (default 0)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness (default 300)")
    p.add_argument("--drain-timeout", type=float, default=2.0,
                   help="at Ctrl-C/SIGTERM: seconds in-flight requests get to finish (default 2; the whole stop "
                        "then takes at most about this + 3 s)")
    p.add_argument("--watch-interval", type=float, default=0.5, help="watchdog: seconds between stub checks")
    p.add_argument("--probe-interval", type=float, default=5.0,
                   help="watchdog: seconds between canary requests (0: no canary)")
    p.add_argument("--heal-timeout", type=float, default=50.0,
                   help="watchdog: seconds a broken model gets to be healed before serve exits 3 (default 50)")
    p.add_argument("--no-watchdog", action="store_true", help="do not watch the models")
    p.add_argument("--install-server", action="store_true",
                   help="install the tritonserver bundled in nvidia-pytriton (pip --no-deps, pinned hash) into "
                        "kkdeploy's cache; serve afterwards when --artifacts is given")
    p.set_defaults(func=run)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def run(args) -> int:
    from ..serving import triton_server
    from ..serving.triton_repo import write_repository
    from ..serving.watchdog import EXIT_NOT_HEALED, HealFailed

    if args.install_server:
        install = triton_server.install_server(log=console.print)
        console.print(f"tritonserver: {install.describe()}", soft_wrap=True)
        if not args.artifacts:
            return 0
    if not args.artifacts:
        raise KKError("give --artifacts DIR (written by `kkdeploy build`), or --install-server alone to install")
    if not Path(args.artifacts).is_dir():
        raise KKError(f"{args.artifacts} is not a directory; pass the artifact directory written by `kkdeploy build`")
    for flag in ("drain_timeout", "watch_interval", "heal_timeout"):
        if getattr(args, flag) <= 0:
            raise KKError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    install = triton_server.locate_server()
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    triton_server.check_ports(args.address, ports)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    workdir = Path(tempfile.mkdtemp(prefix="kkdeploy-serve-"))
    server = None
    models: list[str] = []
    token = secrets.token_hex(8)
    canary_file = workdir / "canary.json"
    try:
        info = write_repository(args.artifacts, workdir / "repository", model_name=args.model_name,
                                engine=args.engine, max_queue_delay_us=args.max_queue_delay_us,
                                available_backends=install.backends(), topology=args.topology,
                                instances=args.instances,
                                parameters={"kkdeploy_serve_token": token, "kkdeploy_canary_file": str(canary_file)})
        if info.device_type == "cuda" and not Path("/dev/nvidiactl").exists():
            raise KKError(f"{args.artifacts} was built for CUDA ({info.candidate}); serve it on a machine with "
                          f"that GPU, or build CPU artifacts with --device cpu")
        if info.topology == "one-hop":
            console.print(f"repository {info.path}: {info.model} (one hop, 1..{info.max_batch} sequences, buckets "
                          f"{info.buckets}: {info.engine_reason})", soft_wrap=True)
            models = [info.model]
        else:
            console.print(f"repository {info.path}: {info.model} (python front, 1..{info.batch_size} sequences) -> "
                          f"{info.engine_model} ({info.engine_backend}: {info.engine_reason})", soft_wrap=True)
            models = [info.model, info.engine_model]
        server = triton_server.TritonServer(
            install, Path(info.path), workdir, address=args.address, exit_timeout_s=SERVER_EXIT_TIMEOUT_S,
            extra_args=["--model-control-mode=explicit", "--load-model=*"],
            **{f"{k}_port": v for k, v in ports.items()})
        server.start()
        console.print(f"tritonserver pid {server.pid}: {install.binary}; log {server.log_path}", soft_wrap=True)
        start = time.monotonic()

        def ours() -> bool:  # the server answering is the one we started: its config carries our token
            config = server.http_json(f"/v2/models/{info.model}/config") or {}
            value = ((config.get("parameters") or {}).get("kkdeploy_serve_token") or {}).get("string_value")
            return value == token

        server.wait_ready(args.ready_timeout, owner=ours)
        canary = check_canary(args, info, server, canary_file)
        console.print(f"ready in {time.monotonic() - start:.1f} s: "
                      f"http://{server.http_url}/v2/models/{info.model}/infer  grpc {server.grpc_url}  "
                      f"metrics {server.metrics_url}  (Ctrl-C stops)", soft_wrap=True)
        watchdog = None
        if not args.no_watchdog:
            from ..serving.watchdog import Watchdog

            watchdog = Watchdog(server, models, canary, lambda line: console.print(line, soft_wrap=True),
                                interval_s=args.watch_interval, probe_every_s=args.probe_interval or float("inf"),
                                heal_timeout_s=args.heal_timeout)
            watchdog.baseline()
        while server.alive():
            if watchdog is not None:
                watchdog.step()
            time.sleep(args.watch_interval)
        raise KKError(f"tritonserver exited (code {server.process.returncode}): {server.failure_reason()}")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return stop(server, models, args.drain_timeout)
    except HealFailed as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        err_console.print(f"[bold red]error:[/] {exc}; exiting {EXIT_NOT_HEALED} so that a supervisor restarts "
                          f"kkdeploy serve", soft_wrap=True)
        stop(server, models, args.drain_timeout)
        return EXIT_NOT_HEALED
    except KKError as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if server is not None and server.log_path.is_file():  # the work directory goes; the log stays
            kept = Path(tempfile.gettempdir()) / "kkdeploy-serve-last.log"
            shutil.copyfile(server.log_path, kept)
            server.stop(timeout_s=3)
            raise KKError(str(exc).replace(str(server.log_path), str(kept))) from None
        raise
    finally:
        try:
            if server is not None and server.process is not None and server.process.poll() is None:
                server.stop(timeout_s=3)
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            shutil.rmtree(workdir, ignore_errors=True)


def check_canary(args, info, server, canary_file: Path):
    """The canary's pinned answers, recorded by the model at start; on a CPU artifact also checked against
    ``kkdeploy.load`` here, bit for bit. The first canary request must get one of them."""
    if args.no_watchdog:
        return None
    from ..serving.watchdog import Canary

    config = info.config
    canary = Canary.from_file(canary_file, info.model, config["seq_len"], config["d_model"], info.dtype)
    if info.device_type == "cpu":
        import torch

        import kkdeploy
        from ..pipeline.runtime import bucketed
        from ..serving.triton_model import canary_answers

        runner = bucketed(kkdeploy.load(args.artifacts, device="cpu"))
        dtype = {"float32": torch.float32, "float16": torch.float16}[info.dtype]
        with torch.inference_mode():
            direct = canary_answers(runner.run_bucket, [int(b) for b in canary.answers], config["seq_len"],
                                    config["d_model"], dtype, torch.device("cpu"))
        if {str(k): v for k, v in direct.items()} != canary.answers:
            raise KKError("the served model's answer differs from kkdeploy.load's on the same artifacts; check "
                          "that the server's Python has the same libraries as this one")
    wrong = canary.ask(server.http_url)
    if wrong:
        raise KKError(f"the server is up but not serving right: {wrong}")
    return canary


def stop(server, models: list[str], drain_timeout_s: float) -> int:
    """Unload the models (readiness false; Triton lets in-flight requests finish first), then SIGTERM the server;
    0 for a clean stop (drained in time, no process killed or left), else 1 with the reason."""
    if server is None or server.process is None:
        console.print("stopped before the server started")
        return 0
    began = time.monotonic()
    console.print(f"stopping: unloading {', '.join(models)} (not ready); in-flight requests get up to "
                  f"{drain_timeout_s:g} s", soft_wrap=True)
    deadline = began + drain_timeout_s
    drained = server.alive()
    for model in models:  # the front before its engine: the front's in-flight requests still need the engine
        if not server.unload(model, timeout_s=max(0.5, deadline - time.monotonic())):
            drained = False
            continue
        while server.alive() and server.model_states().get(model) not in ("UNAVAILABLE", None):
            if time.monotonic() > deadline:
                drained = False
                break
            time.sleep(0.05)
    code = server.stop(timeout_s=SERVER_EXIT_TIMEOUT_S + 1.5)
    left = server.group_members()
    elapsed = time.monotonic() - began
    log = server.log_text()
    timeout_only = "Exit timeout expired" in log and "Found 0 model versions that have in-flight inferences" in log
    problems = []
    if not drained:
        problems.append(f"requests were still in flight after {drain_timeout_s:g} s")
    if server.killed:
        problems.append("processes had to be killed")
    if left:
        problems.append(f"processes left: {left}")
    if code not in (0, None) and not (timeout_only and drained):
        problems.append(f"tritonserver exited with code {code}: {server.failure_reason()}")
    note = " (idle client connections closed at its exit timeout)" if code and timeout_only and drained else ""
    console.print(f"tritonserver stopped in {elapsed:.1f} s (exit code {code}{note})"
                  + (f"; processes left: {left}" if left else "; no process left"), soft_wrap=True)
    if problems:
        err_console.print(f"[bold red]error:[/] unclean stop: {'; '.join(problems)}", soft_wrap=True)
        return EXIT_UNCLEAN_STOP
    return 0
