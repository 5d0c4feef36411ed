"""Compile our CUDA C++ kernels with nvcc, on demand, cached by source and toolchain.

Why nvcc and not Triton for some kernels: a kernel that must be bit-identical to an ATen CUDA kernel is safest
written the way ATen's is and compiled the way PyTorch compiles it: nvcc with its floating-point defaults (no
fast math, FMA contraction on, IEEE division and square root), so ``expf``, divisions and contractions come out
the same. Used by ``engines.custom_op_library`` (the ONNX Runtime custom ops) and by
``kkdeploy.kernels.block_softmax``. Cache: ``$KKDEPLOY_CACHE_DIR`` (default ``~/.cache/kkdeploy``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from kkdeploy.errors import KKError

# nvcc's defaults for floating point (no --use_fast_math, -fmad=true), as PyTorch's kernels are built.
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC")
NVCC_FALLBACK = "/usr/local/cuda/bin/nvcc"
BUILDER_VERSION = "1"


def cache_root() -> Path:
    return Path(os.environ.get("KKDEPLOY_CACHE_DIR") or "~/.cache/kkdeploy").expanduser()


def cxx_compiler(what: str, otherwise: str = "") -> str:
    """The C++ compiler: ``$CXX``, else g++; a one-line KKError naming ``what`` needs it and the fix when there is
    none (``otherwise``: a way around it, appended)."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise KKError(f"{what} needs a C++17 compiler and {cxx!r} is not on PATH; install one (apt-get install g++) or "
                      f"set CXX{otherwise}")
    return cxx


def run(cmd: list[str], cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1][:200] if lines else f"exit code {proc.returncode}"


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str) -> str:
    """The first line of ``compiler --version`` (nvcc's names its release), or the path if that fails."""
    proc = run([compiler, "--version"], timeout=30)
    if proc.returncode != 0 or not proc.stdout:
        return compiler
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    release = [line for line in lines if "release" in line]
    return release[0] if release else lines[0]


def nvcc() -> str:
    """The CUDA compiler: ``$NVCC``, else nvcc on PATH, else /usr/local/cuda/bin/nvcc; KKError when none."""
    override = os.environ.get("NVCC")
    if override:
        if not (Path(override).is_file() and os.access(override, os.X_OK)):
            raise KKError(f"NVCC={override} is not an executable; point it at the CUDA toolkit's nvcc")
        return override
    for candidate in (shutil.which("nvcc"), NVCC_FALLBACK):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise KKError("the kkdeploy CUDA kernels need nvcc (the CUDA toolkit) and none was found; install the "
                  "toolkit, set NVCC, or build for --device cpu")


@functools.lru_cache(maxsize=None)
def cuda_architecture(device: str) -> str:
    """``sm_XY`` of the GPU the kernels are compiled for (they are proven per architecture)."""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"



def require_gpu(what: str) -> None:
    if not torch.cuda.is_available():
        raise KKError(f"{what} are compiled for the GPU that runs them and this machine has none; build on the "
                      f"GPU machine (--device cuda there) or use --device cpu")


def gencode(arch: str) -> str:
    return f"arch=compute_{arch[3:]},code={arch}"


def build_kernel_library(name: str, sources: list[Path], device: torch.device | str = "cuda",
                         link: tuple[str, ...] = ()) -> Path:
    """``lib<name>.so`` from CUDA sources (kernels behind a C interface, loaded with ctypes), compiled for
    this GPU and cached by the sources' bytes, nvcc's version, the flags and the architecture."""
    device = torch.device(device)
    require_gpu(f"the {name} kernels")
    compiler = nvcc()
    arch = cuda_architecture(str(device))
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    env = {"builder": BUILDER_VERSION, "nvcc": compiler_version(compiler), "flags": NVCC_FLAGS, "arch": arch,
           "link": link, "platform": platform.platform()}
    digest.update(json.dumps(env, sort_keys=True).encode())
    target_dir = cache_root() / "kernels" / f"{name}-{digest.hexdigest()[:24]}"
    library = target_dir / f"lib{name}.so"
    if library.is_file():
        return library
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=target_dir) as tmp:
        staged = Path(tmp) / library.name
        cmd = [compiler, *NVCC_FLAGS, "-shared", "-gencode", gencode(arch), *(str(s) for s in sources if
                                                                             s.suffix == ".cu"), *link, "-o",
               str(staged)]
        proc = run(cmd)
        if proc.returncode != 0:
            raise KKError(f"compiling the {name} kernels failed: {last_line(proc)}")
        (target_dir / "build.json").write_text(json.dumps({"command": cmd, **env}, indent=1))
        os.replace(staged, library)
    return library


@functools.lru_cache(maxsize=None)
def load_problem(load: Callable[[str], object], device: str) -> Optional[str]:
    """None when ``load(device)`` (a kernel module's cached build-and-dlopen) succeeds, else its one-line reason.
    Cached, so a machine without nvcc tries the build once, not on every call."""
    try:
        load(device)
    except (KKError, OSError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None
