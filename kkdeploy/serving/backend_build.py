"""Compile kkdeploy's in-process Triton backend (``csrc/kkdeploy_backend.cc``) for this machine's Python.

The backend embeds the interpreter, so it is linked against the serving Python's ``libpython3.X.so`` and compiled
where it serves: with the C++ compiler found here (``$CXX``, else ``g++``: ``cuda_build.cxx_compiler``), against
Triton's backend API headers shipped in ``csrc/third_party/triton`` (Triton 2.51, the server bundled by nvidia-pytriton
0.7.0). The library is cached under ``$KKDEPLOY_CACHE_DIR/triton-backend/<key>/libtriton_kkdeploy.so``, keyed by the
sources' bytes, the
compiler's version and the Python it embeds, and written atomically (a half-written library is never found).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from ..errors import KKError
from ..kernels.cuda_build import cache_root, compiler_version, cxx_compiler
from .triton_server import python_library_dir

BACKEND_NAME = "kkdeploy"  # config.pbtxt's ``backend:``; Triton looks for ``libtriton_kkdeploy.so``
LIBRARY_NAME = f"libtriton_{BACKEND_NAME}.so"
WHAT = "kkdeploy's in-process Triton backend"
OTHERWISE = "; or serve with --engine python"
CSRC = Path(__file__).with_name("csrc")
THIRD_PARTY = CSRC / "third_party"  # Triton's backend API headers (BSD-3, triton-inference-server/core)
SOURCES = [CSRC / "kkdeploy_backend.cc", THIRD_PARTY / "triton" / "core" / "tritonbackend.h",
           THIRD_PARTY / "triton" / "core" / "tritonserver.h"]


def python_link_flags() -> tuple[list[str], list[str]]:
    """``(compile flags, link flags)`` that embed this Python: its headers, its shared libpython."""
    libdir = python_library_dir(WHAT)  # a Python without a shared libpython is a one-line error
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise KKError(f"Python.h is missing from {include}: install this Python's headers (python3-dev){OTHERWISE}")
    version = f"{sys.version_info.major}.{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    library = libdir / (sysconfig.get_config_var("INSTSONAME") or f"libpython{version}.so")
    if not library.exists():
        raise KKError(f"{library} is missing: this Python's shared libpython is needed to embed it{OTHERWISE}")
    # linked by its path (a distribution's runtime package ships libpython3.X.so.1.0 without the bare .so symlink);
    # the backend re-opens it with RTLD_GLOBAL (Triton opens backends locally; torch's extension modules need the
    # interpreter's symbols in the global scope); its home (sys.base_prefix), where the interpreter finds its
    # standard library inside tritonserver; and the executable torch's compile workers are started with
    return ([f"-I{include}", f'-DKKDEPLOY_LIBPYTHON="{library}"', f'-DKKDEPLOY_PYTHONHOME="{sys.base_prefix}"',
             f'-DKKDEPLOY_PYTHON_EXECUTABLE="{sys.executable}"'],
            [str(library), f"-Wl,-rpath,{libdir}", "-ldl"])


def backend_library(log=None) -> Path:
    """The compiled backend for this Python, built on first use (a few seconds) and cached."""
    cxx = cxx_compiler(WHAT, OTHERWISE)
    compile_flags, link_flags = python_link_flags()
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-pthread", f"-I{THIRD_PARTY}",
             *compile_flags]
    return compiled_library(cxx, SOURCES, flags, link_flags, "triton-backend", LIBRARY_NAME, WHAT, OTHERWISE, log)


def compiled_library(cxx: str, sources: list[Path], flags: list[str], link_flags: list[str], folder: str,
                     name: str, what: str, otherwise: str, log=None) -> Path:
    """``sources[0]`` compiled into the shared library ``name`` under ``$KKDEPLOY_CACHE_DIR/<folder>/<key>/``, keyed
    by every source's bytes, the compiler's version and the flags; written atomically, so a half-written library is
    never found, and a failed compile is a one-line KKError naming ``what`` and the way around it."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update("\0".join([compiler_version(cxx), sys.version, *flags, *link_flags]).encode())
    target_dir = cache_root() / folder / digest.hexdigest()[:24]
    target = target_dir / name
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    partial = target_dir / f".{name}.{os.getpid()}.tmp"
    if log is not None:
        log(f"compiling {what} ({Path(cxx).name}, Python {sys.version.split()[0]})")
    command = [cxx, *flags, "-o", str(partial), str(sources[0]), *link_flags]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KKError(f"compiling {what} failed to run: {exc}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[-300:])
        raise KKError(f"compiling {what} failed: {first}{otherwise}")
    os.replace(partial, target)
    return target
