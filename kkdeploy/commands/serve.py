"""`kkdeploy serve --artifacts DIR`: run Triton Inference Server on the artifacts until interrupted.

The repository is written to a temporary directory (removed at exit) and served by the ``tritonserver`` that
``kkdeploy.serving.triton_server`` finds; ``--install-server`` installs the one bundled in nvidia-pytriton.
Ctrl-C or SIGTERM stops the server and every process it started, then exits 0.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path

from ..console import console
from ..errors import KKError


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
    p.add_argument("--install-server", action="store_true",
                   help="install the tritonserver bundled in nvidia-pytriton (pip --no-deps, pinned hash) into "
                        "kkdeploy's cache; serve afterwards when --artifacts is given")
    p.set_defaults(func=run)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: stop the server, clean up, exit 0."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def run(args) -> int:
    from ..serving import triton_server
    from ..serving.triton_repo import write_repository

    if args.install_server:
        install = triton_server.install_server(log=console.print)
        console.print(f"tritonserver: {install.describe()}", soft_wrap=True)
        if not args.artifacts:
            return 0
    if not args.artifacts:
        raise KKError("give --artifacts DIR (written by `kkdeploy build`), or --install-server alone to install")
    if not Path(args.artifacts).is_dir():
        raise KKError(f"{args.artifacts} is not a directory; pass the artifact directory written by `kkdeploy build`")
    install = triton_server.locate_server()
    ports = {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    triton_server.check_ports(args.address, ports)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    workdir = Path(tempfile.mkdtemp(prefix="kkdeploy-serve-"))
    server = None
    try:
        info = write_repository(args.artifacts, workdir / "repository", model_name=args.model_name,
                                engine=args.engine, max_queue_delay_us=args.max_queue_delay_us,
                                available_backends=install.backends(), topology=args.topology,
                                instances=args.instances)
        if info.device_type == "cuda" and not Path("/dev/nvidiactl").exists():
            raise KKError(f"{args.artifacts} was built for CUDA ({info.candidate}); serve it on a machine with "
                          f"that GPU, or build CPU artifacts with --device cpu")
        if info.topology == "one-hop":
            console.print(f"repository {info.path}: {info.model} (one hop, 1..{info.max_batch} sequences, buckets "
                          f"{info.buckets}: {info.engine_reason})", soft_wrap=True)
        else:
            console.print(f"repository {info.path}: {info.model} (python front, 1..{info.batch_size} sequences) -> "
                          f"{info.engine_model} ({info.engine_backend}: {info.engine_reason})", soft_wrap=True)
        server = triton_server.TritonServer(install, Path(info.path), workdir, address=args.address, **{
            f"{k}_port": v for k, v in ports.items()})
        server.start()
        console.print(f"tritonserver pid {server.pid}: {install.binary}; log {server.log_path}", soft_wrap=True)
        start = time.monotonic()
        server.wait_ready(args.ready_timeout)
        console.print(f"ready in {time.monotonic() - start:.1f} s: "
                      f"http://{server.http_url}/v2/models/{info.model}/infer  grpc {server.grpc_url}  "
                      f"metrics {server.metrics_url}  (Ctrl-C stops)", soft_wrap=True)
        while server.alive():
            time.sleep(0.5)
        raise KKError(f"tritonserver exited (code {server.process.returncode}): {server.failure_reason()}")
    except KeyboardInterrupt:
        console.print(f"stopping tritonserver (it waits up to {triton_server.EXIT_TIMEOUT_S} s for open client "
                      f"connections) ...")
        return 0
    except KKError as exc:
        if server is not None and server.log_path.is_file():  # the work directory goes; the log stays
            kept = Path(tempfile.gettempdir()) / "kkdeploy-serve-last.log"
            shutil.copyfile(server.log_path, kept)
            raise KKError(str(exc).replace(str(server.log_path), str(kept))) from None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            if server is not None:
                code = server.stop()
                left = server.group_members()
                console.print(f"tritonserver stopped (exit code {code})"
                              + (f"; processes left: {left}" if left else "; no process left"))
        finally:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            shutil.rmtree(workdir, ignore_errors=True)
