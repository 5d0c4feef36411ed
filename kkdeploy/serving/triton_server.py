"""Find a ``tritonserver``, run it on a model repository, and stop it leaving no process behind.

Where the server comes from. The ``nvidia-pytriton`` wheel (PyPI) bundles a real ``tritonserver`` with the Python
backend and a backend stub per Python version. Its metadata pins ``numpy<2``, which would downgrade this
project's numpy (2.x) in every environment that lists it as a dependency; and PyTriton's own Python glue is not
used (it fails on Python 3.11.7). So kkdeploy installs only the wheel's files: ``install_server`` runs
``pip install --no-deps --require-hashes --target <cache>`` on the pinned wheel, which leaves site-packages (and
numpy) untouched. The stub's own numpy bridge misreads arrays under numpy 2, which is why our Python-backend
model moves every tensor as DLPack (see ``triton_model``). ``find_server`` also accepts a Triton install named by
``KKDEPLOY_TRITONSERVER``, an importable ``pytriton`` package, and a ``tritonserver`` on PATH (the NGC container's
``/opt/tritonserver``).

Lifecycle. The server runs in its own session (process group), so the Python-backend stubs it spawns can be
found and ended with it; it is asked to die with its parent (``PR_SET_PDEATHSIG``) so a killed ``kkdeploy serve``
cannot orphan it. ``stop`` asks politely (SIGTERM: Triton unloads its models and ends its stubs), then kills the
whole group, then removes any shared-memory region a killed stub left in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KKError
from ..processes import death_signal_hook

PYTRITON_VERSION = "0.7.0"
# sha256 of the two published wheels of nvidia-pytriton 0.7.0 (PyPI), checked by pip (--require-hashes).
PYTRITON_WHEEL_SHA256 = {
    "x86_64": "21f063ff93bb426d0c06b7a55e7eb9efcfe62c0dddd9a908e9877e18710128df",
    "aarch64": "f99e07ee56fe065337453956afba17d2673e02ec6a632c3de26ce6e7b32a0898",
}
ENV_SERVER = "KKDEPLOY_TRITONSERVER"
ENV_CACHE = "KKDEPLOY_CACHE_DIR"
ENV_SITE_DIRS = "KKDEPLOY_SITE_DIRS"  # read by triton_model: site dirs (with their .pth files) of this Python
INSTALL_COMMAND = "kkdeploy serve --install-server"
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
EXIT_TIMEOUT_S = 10  # --exit-timeout-secs: in-flight requests and open client connections get this long
# --metrics-interval-ms: Triton's metrics thread sleeps half of it between polls (CPU, GPU utilisation), and the
# server's exit waits for that sleep: at the default 2000 ms, up to 1 s of every stop (0.8 s measured on the CPU).
METRICS_INTERVAL_MS = 200
_SHM_PREFIX = "triton_python_backend_shm_region_"
# Log lines a CPU machine always shows (no GPU, no NVML/DCGM): never the reason a server failed.
_BENIGN = r"NVML|DCGM|CudaDriverHelper|CUDA driver|pinned memory"


# -- where the server is ----------------------------------------------------------------------------------------
@dataclass
class ServerInstall:
    """A Triton installation: ``root/bin/tritonserver`` and ``root/backends/<name>/``."""

    root: Path
    source: str  # how it was found, for messages
    lib_dirs: list[Path] = field(default_factory=list)  # bundled shared libraries (nvidia_pytriton.libs)
    stubs: Path | None = None  # python_backend_stubs/<major.minor>/ (pytriton layout: one stub per Python)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    def backends(self) -> set[str]:
        folder = self.root / "backends"
        return {p.name for p in folder.iterdir() if p.is_dir()} if folder.is_dir() else set()

    def describe(self) -> str:
        return f"{self.binary} ({self.source}; backends: {', '.join(sorted(self.backends())) or 'none'})"


def cache_dir() -> Path:
    base = os.environ.get(ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "kkdeploy")
    return Path(base) / "tritonserver"


def _install_from_root(root: Path, source: str) -> ServerInstall | None:
    root = Path(root)
    if not (root / "bin" / "tritonserver").is_file():
        return None
    libs = [d for d in (root.parent.parent / "nvidia_pytriton.libs", root / "lib") if d.is_dir()]
    stubs = root / "python_backend_stubs"
    return ServerInstall(root=root, source=source, lib_dirs=libs, stubs=stubs if stubs.is_dir() else None)


def _managed_root() -> Path:
    return cache_dir() / f"nvidia-pytriton-{PYTRITON_VERSION}" / "pytriton" / "tritonserver"


def find_server() -> ServerInstall | None:
    """The first Triton found: $KKDEPLOY_TRITONSERVER, kkdeploy's own install, a ``pytriton`` package, PATH."""
    named = os.environ.get(ENV_SERVER)
    if named:
        path = Path(named)
        root = path.parent.parent if path.is_file() else path
        found = _install_from_root(root, f"${ENV_SERVER}")
        if found is None:
            raise KKError(f"{ENV_SERVER}={named} holds no bin/tritonserver; point it at a Triton install "
                          f"(such as /opt/tritonserver) or unset it and run `{INSTALL_COMMAND}`")
        return found
    found = _install_from_root(_managed_root(), f"installed by `{INSTALL_COMMAND}`")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("pytriton")  # locates the package without importing its (numpy<2) glue
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found = _install_from_root(Path(location) / "tritonserver", "the nvidia-pytriton package")
            if found:
                return found
    on_path = shutil.which("tritonserver")
    for candidate in ([Path(on_path).resolve().parent.parent] if on_path else []) + [Path("/opt/tritonserver")]:
        found = _install_from_root(candidate, "PATH" if on_path else "/opt/tritonserver")
        if found:
            return found
    return None


def locate_server() -> ServerInstall:
    """``find_server`` or a one-line error that names the install command."""
    found = find_server()
    if found is None:
        raise KKError(f"no tritonserver found: run `{INSTALL_COMMAND}` (pip installs the server bundled in "
                      f"nvidia-pytriton {PYTRITON_VERSION} with --no-deps into {cache_dir()}; numpy stays 2.x), "
                      f"or set {ENV_SERVER} to a Triton install such as /opt/tritonserver")
    return found


def install_server(force: bool = False, log=None) -> ServerInstall:
    """Install the pinned nvidia-pytriton wheel's files (not its dependencies) into kkdeploy's cache.

    ``pip install --no-deps --require-hashes --target``: the ordinary client, the wheel's published hash, and no
    change to site-packages, so the wheel's ``numpy<2`` pin never reaches this environment. Atomic: a staging
    directory is renamed into place only after pip succeeded."""
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in PYTRITON_WHEEL_SHA256:
        raise KKError(f"nvidia-pytriton {PYTRITON_VERSION} ships tritonserver for Linux x86_64 and aarch64 only; "
                      f"this is {sys.platform} {machine}: use the NGC Triton container and set {ENV_SERVER}")
    target = _managed_root().parent.parent
    if not force:
        existing = _install_from_root(_managed_root(), f"installed by `{INSTALL_COMMAND}`")
        if existing:
            return existing
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    try:
        requirements = stage / "requirements.txt"
        hashes = " ".join(f"--hash=sha256:{h}" for h in PYTRITON_WHEEL_SHA256.values())
        requirements.write_text(f"nvidia-pytriton=={PYTRITON_VERSION} {hashes}\n")
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:",
                   "--require-hashes", "--no-compile", "--disable-pip-version-check", "--no-warn-script-location",
                   "--quiet", "--target", str(stage / "pkg"), "-r", str(requirements)]
        if log:
            log(f"installing tritonserver from nvidia-pytriton {PYTRITON_VERSION} (pip --no-deps) into {target}")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines()
                     if ln.strip() and not ln.startswith("WARNING")]
            raise KKError(f"pip could not install nvidia-pytriton {PYTRITON_VERSION}: "
                          f"{lines[-1] if lines else f'exit code {done.returncode}'}")
        if not (stage / "pkg" / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
            raise KKError(f"the nvidia-pytriton {PYTRITON_VERSION} wheel has no pytriton/tritonserver/bin/tritonserver")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.rename(target, old)
        try:
            os.rename(stage / "pkg", target)
        except OSError:  # another installer won the race: keep its copy
            if old.exists() and not target.exists():
                os.rename(old, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    installed = _install_from_root(_managed_root(), f"installed by `{INSTALL_COMMAND}`")
    if installed is None:  # pragma: no cover - checked above
        raise KKError(f"tritonserver is missing from {target} after the install; retry with --install-server")
    return installed


# -- ports --------------------------------------------------------------------------------------------------------
def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port``. SO_REUSEADDR, as the server binds: a port in TIME_WAIT after
    an earlier server is free for it, a listening one is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            if exc.errno == errno.EACCES:
                raise KKError(f"port {port} on {host} needs privileges this user lacks; choose a port above 1023") \
                    from None
            raise KKError(f"cannot bind {host}:{port}: {exc.strerror}; choose another --address") from None
    return False


def free_port(host: str = "127.0.0.1", avoid: set[int] = frozenset()) -> int:
    """A port nothing listens on now (the kernel's pick); ``avoid`` keeps several picks distinct."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise KKError("no free port found")  # pragma: no cover


def free_ports(host: str = "127.0.0.1") -> dict[str, int]:
    """``{"http", "grpc", "metrics": port}``: three distinct ports nothing listens on now (``free_port``)."""
    taken: set[int] = set()
    for _ in range(3):
        taken.add(free_port(host, avoid=taken))
    return dict(zip(("http", "grpc", "metrics"), sorted(taken)))


def check_ports(host: str, ports: dict[str, int]) -> None:
    """One-line errors for an invalid, repeated or taken port, before the server tries them."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if not 1 <= int(port) <= 65535:
            raise KKError(f"--{name}-port must be in 1..65535, got {port}")
        if port in seen:
            raise KKError(f"--{name}-port and --{seen[port]}-port are both {port}; give each endpoint its own port")
        seen[port] = name
    for name, port in ports.items():
        if port_in_use(host, port):
            raise KKError(f"port {port} ({name}) is already in use on {host}; choose another with --{name}-port")


# -- the server process -------------------------------------------------------------------------------------------


def python_library_dir(embedder: str = "the Triton Python-backend stub") -> Path:
    """The folder holding this Python's ``libpython3.X.so``: the stub (or kkdeploy's in-process backend) must embed
    this interpreter, not another 3.X that the loader would find first (Debian's, for a pyenv Python)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise KKError(f"this Python ({sys.executable}) was built without a shared libpython, which {embedder} "
                      f"embeds: use a Python built with --enable-shared (Debian's python3, pyenv with "
                      f"PYTHON_CONFIGURE_OPTS=--enable-shared) or the NGC Triton container")
    return Path(sysconfig.get_config_var("LIBDIR"))


def _site_dirs() -> list[str]:
    """Where the server's Python (the stub, or the interpreter the in-process backend embeds) finds what this one
    imports: the site directories, and last the folder that holds the running ``kkdeploy`` (with ``engines`` and
    ``validation`` beside it), for a source checkout run without an install or beside a stale one."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    source_root = str(Path(__file__).resolve().parents[2])
    if source_root not in dirs:
        dirs.append(source_root)
    return dirs


def _process_table() -> list[tuple[int, int, str, str]]:
    """(pid, pgid, state, cmdline) of every process we can read."""
    rows = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        rows.append((int(entry.name), int(fields[2]), fields[0], cmd))
    return rows


def processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``text``: a repository path finds its server
    and every Python-backend stub serving from it."""
    me = os.getpid()
    return [pid for pid, _, state, cmd in _process_table() if text in cmd and state != "Z" and pid != me]


class TritonServer:
    """``tritonserver`` on one repository: ``start()``, ``wait_ready()``, ``stop()``; also a context manager.

    ``workdir`` receives the backend folder (the Python backend with this Python's stub) and the server log."""

    def __init__(self, install: ServerInstall, repository: Path, workdir: Path, *, address: str = "127.0.0.1",
                 http_port: int = DEFAULT_PORTS["http"], grpc_port: int = DEFAULT_PORTS["grpc"],
                 metrics_port: int = DEFAULT_PORTS["metrics"], exit_timeout_s: int = EXIT_TIMEOUT_S,
                 extra_args: list[str] | None = None):
        self.install = install
        self.repository = Path(repository).resolve()
        self.workdir = Path(workdir).resolve()
        self.address = address
        self.ports = {"http": int(http_port), "grpc": int(grpc_port), "metrics": int(metrics_port)}
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args or [])
        self.log_path = self.workdir / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        self._shm_regions: set[str] = set()
        self.last_load_error: str | None = None  # why the last load failed (``load``)
        self.killed = False  # whether the last stop needed SIGKILL
        self.server_killed = False  # whether that SIGKILL found the server itself still running

    # endpoints
    @property
    def host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "") else ("::1" if self.address == "::" else self.address)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports['metrics']}/metrics"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    # setup
    def backend_directory(self) -> Path:
        """The install's backends, with the Python backend's stub for this Python where the install ships one
        per version (the pytriton layout); an NGC install is used as it is."""
        if self.install.stubs is None:
            return self.install.root / "backends"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = self.install.stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            shipped = ", ".join(sorted(p.name for p in self.install.stubs.iterdir())) or "none"
            raise KKError(f"{self.install.binary} has no Python-backend stub for Python {version} (it has: {shipped}); "
                          f"run kkdeploy with one of those Pythons")
        target = self.workdir / "backends"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for entry in (self.install.root / "backends").iterdir():
            if entry.name == "python":
                shutil.copytree(entry, target / "python")
                shutil.copy2(stub, target / "python" / stub.name)
            else:
                (target / entry.name).symlink_to(entry, target_is_directory=True)
        return target

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_SITE_DIRS] = os.pathsep.join(_site_dirs())
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.install.stubs is not None:  # the stub embeds *this* interpreter: its libpython, its stdlib
            libs = [str(python_library_dir())] + [str(d) for d in self.install.lib_dirs]
            if env.get("LD_LIBRARY_PATH"):
                libs.append(env["LD_LIBRARY_PATH"])
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
            env["PYTHONHOME"] = sys.base_prefix
        return env

    def command(self, backend_dir: Path) -> list[str]:
        gpu = Path("/dev/nvidiactl").exists()
        return [str(self.install.binary), f"--model-repository={self.repository}",
                f"--backend-directory={backend_dir}",
                f"--http-address={self.address}", f"--http-port={self.ports['http']}",
                f"--grpc-address={self.address}", f"--grpc-port={self.ports['grpc']}",
                f"--metrics-address={self.address}", f"--metrics-port={self.ports['metrics']}",
                f"--allow-gpu-metrics={'true' if gpu else 'false'}", f"--metrics-interval-ms={METRICS_INTERVAL_MS}",
                "--disable-auto-complete-config", "--strict-readiness=true",
                f"--exit-timeout-secs={self.exit_timeout_s}", *self.extra_args]

    # lifecycle
    def start(self) -> "TritonServer":
        if self.process is not None:
            raise KKError("this server was already started")
        if not self.install.binary.is_file():
            raise KKError(f"{self.install.binary} is missing; run `{INSTALL_COMMAND}`")
        check_ports(self.address, self.ports)
        self.workdir.mkdir(parents=True, exist_ok=True)
        backend_dir = self.backend_directory()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(backend_dir), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environment(),
                                            start_new_session=True, preexec_fn=death_signal_hook())
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self, ready_timeout_s: float = 300.0, owner=None) -> "TritonServer":
        """The same server again (repository, ports, flags) after this one died: what is left of it (its stubs) is
        stopped, its log kept as ``tritonserver.log.previous``, and the new one waited for (``wait_ready``)."""
        self.stop(timeout_s=1)
        if self.log_path.is_file():
            os.replace(self.log_path, self.log_path.with_name(self.log_path.name + ".previous"))
        self.process = None
        self.start()
        return self.wait_ready(ready_timeout_s, owner=owner)

    def ready(self) -> bool:
        return self.http_status("/v2/health/ready") == 200

    def http_status(self, path: str, method: str = "GET", timeout_s: float = 2.0) -> int | None:
        """The HTTP status of ``path`` on this server's HTTP endpoint; None when nothing answers."""
        request = urllib.request.Request(f"http://{self.http_url}{path}", method=method,
                                         data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                reply.read()
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    def http_json(self, path: str, method: str = "GET", timeout_s: float = 2.0):
        """The JSON body of ``path`` (None when nothing answers or the status is not 200)."""
        import json

        request = urllib.request.Request(f"http://{self.http_url}{path}", method=method,
                                         data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return json.loads(reply.read() or b"null")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    # explicit model control (the server must run with --model-control-mode=explicit)
    def unload(self, model: str, timeout_s: float = 10.0) -> bool:
        return self.http_status(f"/v2/repository/models/{model}/unload", "POST", timeout_s) == 200

    def load(self, model: str, timeout_s: float = 300.0) -> bool:
        """Load (or reload) ``model``; returns when Triton has loaded it or failed to. On failure
        ``last_load_error`` says why, in Triton's words (or that nothing answered in time)."""
        import json

        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/models/{model}/load", method="POST",
                                         data=b"{}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                reply.read()
                self.last_load_error = None if reply.status == 200 else f"HTTP {reply.status}"
        except urllib.error.HTTPError as exc:
            try:
                said = json.loads(exc.read() or b"null")
            except (OSError, ValueError):
                said = None
            why = said.get("error") if isinstance(said, dict) else None
            self.last_load_error = f"HTTP {exc.code}: {why or exc.reason}"
        except (urllib.error.URLError, OSError) as exc:
            self.last_load_error = f"no answer within {timeout_s:.0f} s ({exc})"
        return self.last_load_error is None

    def wait_unloaded(self, model: str, timeout_s: float = 30.0) -> bool:
        """Until ``model`` is neither READY nor UNLOADING. Triton's unload returns once the unload has started
        (its instances are finalized after), and its documentation asks for the unload to be over before the
        model is loaded again. False when it is not over within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.model_states().get(model)
            if state not in ("READY", "UNLOADING"):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def reload(self, model: str, timeout_s: float = 300.0) -> bool:
        """Unload ``model``, wait for the unload to finish, and load it again (``last_load_error`` says why not)."""
        deadline = time.monotonic() + timeout_s
        if not self.unload(model, min(10.0, timeout_s)):
            self.last_load_error = "Triton refused the unload"
            return False
        if not self.wait_unloaded(model, max(1.0, deadline - time.monotonic())):
            self.last_load_error = f"the unload did not finish within {timeout_s:.0f} s"
            return False
        return self.load(model, max(1.0, deadline - time.monotonic()))

    def model_states(self, timeout_s: float = 2.0) -> dict[str, str]:
        """``{model: state}`` from the repository index (READY, UNLOADING, UNAVAILABLE, LOADING); empty when the
        server does not answer within ``timeout_s``."""
        index = self.http_json("/v2/repository/index", "POST", timeout_s=timeout_s) or []
        return {m.get("name"): m.get("state", "") for m in index if isinstance(m, dict)}

    def model_ready(self, model: str) -> bool:
        return self.http_status(f"/v2/models/{model}/ready") == 200

    def stub_pids(self) -> dict[str, list[int]]:
        """``{model: [pid]}`` of the live Python-backend stubs serving from this repository."""
        found: dict[str, list[int]] = {}
        if self.process is None:
            return found
        prefix = f"{self.repository}/"
        for pid, pgid, state, cmd in _process_table():
            if pgid != self.process.pid or state == "Z" or "triton_python_backend_stub" not in cmd:
                continue
            for word in cmd.split():
                if word.startswith(prefix) and word.endswith("model.py"):
                    found.setdefault(word[len(prefix):].split("/")[0], []).append(pid)
        return found

    def wait_ready(self, timeout_s: float = 300.0, owner=None) -> "TritonServer":
        """Until the server reports ready; a server that exits or a timeout is a one-line error (and stops it).

        ``owner()``: True when the server answering on our ports is this one (``kkdeploy serve`` asks for its own
        token in a model's config). Another server on the same ports answers ready too; this one's readiness
        is only believed while its process is alive and ``owner()`` holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process else None
                self.stop()
                raise KKError(f"tritonserver exited (code {code}) before it was ready: {self.failure_reason()}")
            if self.ready() and (owner is None or owner()) and self.alive():
                self._note_shm_regions()
                return self
            time.sleep(0.25)
        reason = self.failure_reason()
        self.stop()
        raise KKError(f"tritonserver was not ready after {timeout_s:.0f} s: {reason}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def failure_reason(self) -> str:
        """The most telling line of the server log, kept to one line."""
        text = self.log_text()
        if re.search(r"address already in use|failed to start .*(HTTP|GRPC|Metrics)", text, re.IGNORECASE):
            return (f"a port is already in use on {self.address} (http {self.ports['http']}, grpc "
                    f"{self.ports['grpc']}, metrics {self.ports['metrics']}); choose others with --http-port, "
                    f"--grpc-port, --metrics-port")
        lines = text.splitlines()
        errors = [ln for ln in lines if (re.match(r"^E\d{4} ", ln) or "error:" in ln.lower())
                  and not re.search(_BENIGN, ln)]
        telling = [ln for ln in errors if "failed to load" in ln] or errors
        if not telling:  # a crash: the signal line, not the last frame of the backtrace printed after it
            telling = [ln for ln in lines if re.match(r"^Signal \(\d+\) received", ln.strip())]
        quiet = [ln for ln in lines if ln.strip() and not re.match(r"^\s*\d+# ", ln)]
        line = (telling[0] if telling else (quiet or ["no output"])[-1]).strip()
        line = re.sub(r"^[EWI]\d{4} [\d:.]+ \d+ [\w.]+:\d+\] ", "", line)
        return f"{line[:400]} (log: {self.log_path})"

    def _note_shm_regions(self):
        """Remember the stubs' shared-memory regions: a killed stub cannot remove its own."""
        if self.process is None:
            return
        for pid, pgid, state, cmd in _process_table():
            if pgid == self.process.pid:
                self._shm_regions.update(re.findall(rf"{_SHM_PREFIX}[\w-]+", cmd))

    def group_members(self) -> list[int]:
        """Live processes of the server's process group (the server and its stubs)."""
        if self.process is None:
            return []
        return [pid for pid, pgid, state, _ in _process_table() if pgid == self.process.pid and state != "Z"]

    def stop(self, timeout_s: float | None = None, deadline: float | None = None) -> int | None:
        """SIGTERM (Triton unloads what is still loaded and ends its stubs), then SIGKILL to the whole group.
        Idempotent. Returns the server's exit code. The server gets ``timeout_s`` (default: its exit timeout + 5 s)
        to exit and its stubs 1 s more to end by themselves; or, with ``deadline`` (``time.monotonic()``), both
        until then. ``killed``: something had to be killed; ``server_killed``: the server itself."""
        if self.process is None:
            return None
        self._note_shm_regions()
        if deadline is None:
            grace = (self.exit_timeout_s + 5) if timeout_s is None else timeout_s
        else:
            grace = max(0.0, deadline - time.monotonic())
        self.killed = self.server_killed = False
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # an exited server's stubs end by themselves a moment later
        settle = time.monotonic() + 1.0 if deadline is None else deadline
        while self.process.poll() is not None and self.group_members() and time.monotonic() < settle:
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.group_members() or self.process.poll() is None:
                    self.server_killed = self.server_killed or self.process.poll() is None
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.killed = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1)
            if (self.process.poll() is not None and not self.group_members()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for region in self._shm_regions:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{region}")
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
