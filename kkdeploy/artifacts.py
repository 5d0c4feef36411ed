"""Artifact directories: atomic writes, a build lock, file hashes and the environment record.

A build writes into a staging directory next to the target and renames it into place only
after the manifest is complete, so an interrupted build never leaves a manifest that claims a
pass. A lock file next to the target stops two builds writing one directory.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib
import json
import math
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .errors import KKError

MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "kkdeploy.manifest/1"
WEIGHTS_FILE = "weights.safetensors"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_tree(root: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """sha256 of every file under root, keyed by POSIX relative path."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): file_sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() not in exclude
    }


def json_safe(value):
    """JSON without NaN/Infinity literals: non-finite floats become "nan", "inf" or "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, torch.device):
        return str(value)
    return value


def write_json(path: Path, data) -> Path:
    """Atomic JSON write: a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(json_safe(data), handle, indent=2, allow_nan=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KKError(f"{path} does not exist; run `kkdeploy build` to create artifacts") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KKError(f"{path} is not valid JSON ({exc}); rebuild the artifacts") from None


# -- environment -------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    for dist in {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}.get(module, (module,)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:  # importable without install metadata (a copy carried onto a machine)?
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - absent or broken: no version to report
        return None


def library_versions() -> dict[str, str | None]:
    versions = {name: _version(name) for name in ("torch", "onnx", "onnxruntime", "polygraphy", "tensorrt", "onnxscript")}
    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda
    return versions


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"type": "cuda", "name": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}"}
    return {"type": "cpu", "name": _cpu_name(), "capability": platform.machine()}


def environment(device: torch.device) -> dict:
    return {"device": device_info(device), "versions": library_versions(), "python": platform.python_version()}


def first_difference(recorded: Mapping, here: Mapping, keys: Iterable[str]) -> str | None:
    """The first of ``keys`` whose recorded value differs from this environment's; None when all agree.

    Every check of an artifact against the environment loading it (the manifest's device and library versions,
    an AOTInductor package's keys) compares through here; each caller words the difference as its sentence."""
    return next((key for key in keys if recorded.get(key) != here.get(key)), None)


# -- locking and atomic directories ------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def build_lock(target: Path):
    """An exclusive lock file beside ``target``; a stale lock (dead pid) is taken over."""
    lock = target.parent / f".{target.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                holder = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and _pid_alive(holder):
                raise KKError(
                    f"another build (pid {holder}) is writing {target}; wait for it or remove {lock} if it died"
                ) from None
            lock.unlink(missing_ok=True)
    else:  # pragma: no cover - lost a race twice
        raise KKError(f"cannot take the build lock {lock}; retry")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield lock
    finally:
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_directory(target: Path, force: bool = False):
    """Yield a staging directory that replaces ``target`` only if the block succeeds."""
    target = Path(target).resolve()
    if target.exists() and not target.is_dir():
        raise KKError(f"{target} exists and is not a directory; choose another --out")
    if target.exists() and any(target.iterdir()) and not force:
        raise KKError(f"{target} is not empty; pass --force to replace it or choose another --out")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KKError(f"cannot write to {target.parent}: {exc.strerror}; choose a writable --out") from None
    if not os.access(target.parent, os.W_OK):
        raise KKError(f"{target.parent} is not writable; choose a writable --out")
    with build_lock(target):
        # Under the lock no other build writes here: any staging or old copy left is from a killed build
        # (SIGKILL, out of memory), never a result; remove it.
        for kind in ("staging", "old"):
            for leftover in target.parent.glob(f".{target.name}.{kind}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        stage = target.parent / f".{target.name}.staging-{os.getpid()}"
        stage.mkdir()
        try:
            yield stage
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        if target.exists():
            os.rename(target, old)
        os.rename(stage, target)
        shutil.rmtree(old, ignore_errors=True)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
