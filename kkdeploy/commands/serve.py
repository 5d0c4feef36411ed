"""`kkdeploy serve --artifacts DIR`: run Triton Inference Server on the artifacts until interrupted.

The repository is written to a temporary directory (removed at exit) and served by the ``tritonserver`` that
``kkdeploy.serving.triton_server`` finds; ``--install-server`` installs the one bundled in nvidia-pytriton.

"ready" is printed only once the server answering on our ports is the one this process started (its
process alive, a per-run token in its model config) and a canary request got the validated answer; a watchdog
(``serving.watchdog``) then heals a broken model or exits 3; Ctrl-C or SIGTERM unloads the models (readiness false,
in-flight requests drain up to ``--drain-timeout``), stops the server and every process it started within
``STOP_BUDGET_S`` (4.5 s) of the signal (see ``stop``), and exits 0 only if that stop was clean (1 otherwise).
Setup errors exit 2.
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
# The stop (a supervisor expects it within 5 s of SIGINT/SIGTERM), from the signal, with the default --drain-timeout:
DRAIN_TIMEOUT_S = 2.0  # in-flight requests get this long to be answered (--drain-timeout)
RELEASE_S = 1.3  # then Triton's Python backend checks the stub's health (a fixed 1 s sleep) before finalize()
SERVER_EXIT_S = 0.6  # SIGTERM to a server whose models are unloaded: it exits at once (measured: 0.03-0.1 s)
KILL_S = 0.4  # the last resort: SIGKILL to the process group, and reaping
AFTER_DRAIN_S = 2.5  # >= the three above, with 0.2 s for the stubs' own exit
assert RELEASE_S + SERVER_EXIT_S + KILL_S + 0.2 <= AFTER_DRAIN_S
STOP_BUDGET_S = DRAIN_TIMEOUT_S + AFTER_DRAIN_S  # 4.5 s: the whole stop, signal to nothing left
SERVER_EXIT_TIMEOUT_S = 0  # tritonserver's --exit-timeout-secs: serve has drained and unloaded before SIGTERM,
# and any longer only keeps idle keep-alive client connections open (Triton waits for them in whole seconds)


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
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help=f"at Ctrl-C/SIGTERM: seconds in-flight requests get to finish (default {DRAIN_TIMEOUT_S:g}; "
                        f"the whole stop then takes at most this + {AFTER_DRAIN_S:g} s)")
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
    from ..serving.cuda_driver import host_wait_wanted

    try:  # the server inherits it and each in-process instance would refuse it: say so before anything starts
        host_wait_wanted()
    except ValueError as exc:
        raise KKError(str(exc)) from None
    install = triton_server.locate_server()
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    triton_server.check_ports(args.address, ports)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    # SIGINT stops the server even where it arrived ignored: a shell starts a background job (`serve &`) with SIGINT
    # ignored, Python then installs no handler, and `kill -INT` would do nothing.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    workdir = Path(tempfile.mkdtemp(prefix="kkdeploy-serve-"))
    server = info = None
    models: list[str] = []
    token = secrets.token_hex(8)
    canary_file = workdir / "canary.json"
    release_dir = workdir / "released"  # each stub's finalize() leaves <model>.<pid> here (see stop)
    try:
        release_dir.mkdir()
        info = write_repository(args.artifacts, workdir / "repository", model_name=args.model_name,
                                engine=args.engine, max_queue_delay_us=args.max_queue_delay_us,
                                available_backends=install.backends(), topology=args.topology,
                                instances=args.instances, output_device=args.output_device, served_here=True,
                                parameters={"kkdeploy_serve_token": token, "kkdeploy_canary_file": str(canary_file),
                                            "kkdeploy_release_dir": str(release_dir)})
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
                                heal_timeout_s=args.heal_timeout,
                                restart=lambda limit_s: server.restart(min(limit_s, args.ready_timeout), ours),
                                stubs=not in_process(info))
            watchdog.baseline()
        while watchdog is not None or server.alive():  # the watchdog restarts a server that died
            if watchdog is not None:
                watchdog.step()
            time.sleep(args.watch_interval)
        raise KKError(f"tritonserver exited (code {server.process.returncode}): {server.failure_reason()}")
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return stop(server, models, args.drain_timeout, release_dir, in_process=in_process(info))
    except HealFailed as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        err_console.print(f"[bold red]error:[/] {keep_log(server, str(exc))}; exiting {EXIT_NOT_HEALED} so that a "
                          f"supervisor restarts kkdeploy serve", soft_wrap=True)
        stop(server, models, args.drain_timeout, release_dir, in_process=in_process(info))
        return EXIT_NOT_HEALED
    except KKError as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if server is not None and server.log_path.is_file():
            server.stop(timeout_s=3)
            raise KKError(keep_log(server, str(exc))) from None
        raise
    finally:
        try:
            if server is not None and server.process is not None and server.process.poll() is None:
                server.stop(timeout_s=3)
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
            shutil.rmtree(workdir, ignore_errors=True)


def keep_log(server, message: str) -> str:
    """The work directory goes at exit; the server's log stays, as ``$TMPDIR/kkdeploy-serve-last.log``, and
    ``message`` names that copy instead of the log it quotes."""
    if server is None or not server.log_path.is_file():
        return message
    kept = Path(tempfile.gettempdir()) / "kkdeploy-serve-last.log"
    shutil.copyfile(server.log_path, kept)
    return message.replace(str(server.log_path), str(kept))


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


def in_process(info) -> bool:
    """Whether the served model runs in tritonserver's own process (kkdeploy's in-process backend)."""
    from ..serving.triton_repo import INPROCESS_BACKEND

    return info is not None and info.engine_backend == INPROCESS_BACKEND


def stop(server, models: list[str], drain_timeout_s: float, release_dir: Path | None = None,
         in_process: bool = False) -> int:
    """Drain, then stop the server and everything it started, within ``drain_timeout_s + AFTER_DRAIN_S`` of now
    (``STOP_BUDGET_S`` with the default); 0 for a clean stop, else 1 with the reason.

    1. Unload the client-facing model (``models[0]``): readiness false at once, Triton refuses new requests to
       it and lets the accepted ones finish.
    2. Drained: one of its stubs has entered ``finalize()`` (``release_dir/<model>.<pid>``). Triton finalizes a
       model's instances only once no request holds the model (1 s after the last: the Python backend's stub
       health check), and then one instance after another, each after its own 1 s check: so the first marker says
       every request was answered, and waiting for all of them would cost a second per instance (``--instances
       4``: 4.8 s, past the budget). With no stub known (already unloaded), the model is UNAVAILABLE. Waited for
       up to ``drain_timeout_s + RELEASE_S``; a model that unloads without any finalize() had its stubs fail.
       Triton's own metrics cannot say this: its pending-request gauge drops a request when it is scheduled,
       before the backend runs it, and no gauge counts the running ones.
    3. Unload the other models (the two-hop engine: its only caller has drained), and give the stubs until the
       budget's last ``SERVER_EXIT_S + KILL_S`` to exit (``model.py`` skips the interpreter's teardown).
    4. SIGTERM: with its models unloaded and ``--exit-timeout-secs 0`` the server exits at once, closing idle
       keep-alive connections; at the budget's last ``KILL_S`` whatever is left of the group is killed, and the
       shared-memory regions of killed stubs removed.

    Clean (exit 0): drained, the server exited by itself, nothing left. The server's exit code 1 "exit timeout
    expired" with no inference in flight (a stub still exiting when it was signalled) is reported but clean."""
    if server is None or server.process is None:
        console.print("stopped before the server started")
        return 0
    began = time.monotonic()
    end = began + drain_timeout_s + AFTER_DRAIN_S
    client, internal = models[0], models[1:]
    console.print(f"stopping: unloading {client} (not ready); in-flight requests get up to {drain_timeout_s:g} s, "
                  f"the whole stop {drain_timeout_s + AFTER_DRAIN_S:g} s", soft_wrap=True)
    # the processes whose finalize() leaves the release marker: the stubs, or the server itself when the engine runs
    # in it (kkdeploy's in-process backend finalizes its instances as soon as no request holds the model)
    stubs = [server.pid] if in_process else server.stub_pids().get(client, [])
    server.unload(client, timeout_s=0.5)
    undrained = wait_released(server, client, stubs, release_dir, began + drain_timeout_s + RELEASE_S)
    drained = undrained is None
    drained_s = time.monotonic() - began
    for model in internal:  # nothing calls them any more (or, not drained, the stop is unclean anyway)
        server.unload(model, timeout_s=0.5)
    settle = end - SERVER_EXIT_S - KILL_S
    while time.monotonic() < settle and server.alive() and any(
            state != "UNAVAILABLE" for state in map(server.model_states(_poll_timeout(settle)).get, models)):
        time.sleep(0.02)
    code = server.stop(deadline=end - KILL_S)
    left = server.group_members()
    elapsed = time.monotonic() - began
    log = server.log_text()
    timeout_only = "Exit timeout expired" in log and "Found 0 model versions that have in-flight inferences" in log
    problems = []
    if undrained == "in flight":
        problems.append(f"requests were still in flight after {drain_timeout_s:g} s")
    elif undrained:
        problems.append(undrained)
    if server.server_killed:
        problems.append("tritonserver had to be killed")
    if left:
        problems.append(f"processes left: {left}")
    if code not in (0, None) and not (timeout_only and drained) and not server.server_killed:
        problems.append(f"tritonserver exited with code {code}: {server.failure_reason()}")
    notes = []
    if drained:
        notes.append(f"every request answered, the model released {drained_s:.2f} s after the signal")
    if code and timeout_only and drained:
        notes.append("a stub was still exiting when the server was signalled")
    if server.killed and not server.server_killed:
        notes.append("processes still running after the server's own exit were killed")
    console.print(f"tritonserver stopped in {elapsed:.1f} s (exit code {code}"
                  + "".join(f"; {n}" for n in notes) + ")"
                  + (f"; processes left: {left}" if left else "; no process left"), soft_wrap=True)
    if problems:
        err_console.print(f"[bold red]error:[/] unclean stop: {'; '.join(problems)}", soft_wrap=True)
        return EXIT_UNCLEAN_STOP
    return 0


def wait_released(server, model: str, stubs: list[int], release_dir: Path | None, until: float) -> str | None:
    """Until ``until`` (``time.monotonic()``): None once a stub of ``model`` (alive when the stop began) has left
    its release marker (``triton_model.release_marker``: Triton finalizes none before every request is answered),
    or, with no stub known, once the model is UNAVAILABLE; else the reason it was not drained."""
    from ..serving.triton_model import release_marker

    markers = [Path(release_marker(str(release_dir), model, pid)) for pid in stubs] if release_dir else []
    while True:
        if any(m.exists() for m in markers):
            return None
        if not server.alive():
            return "tritonserver died while draining"
        if server.model_states(_poll_timeout(until)).get(model) == "UNAVAILABLE":
            if not markers:
                return None
            if not any(m.exists() for m in markers):  # unloaded, yet no stub reached finalize()
                return f"a stub of {model} ended without finalizing (the backend found it unhealthy)"
        if time.monotonic() > until:
            return None if any(m.exists() for m in markers) else "in flight"
        time.sleep(0.02)


def _poll_timeout(until: float) -> float:
    """An HTTP call's timeout that keeps a stop phase within its deadline (and not absurdly short)."""
    return min(1.0, max(0.1, until - time.monotonic()))
