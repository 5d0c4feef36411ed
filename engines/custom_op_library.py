"""Build (on demand) and cache the ``kkdeploy`` ONNX Runtime custom-op library.

Why on demand: the library is native code for this machine's compiler and ORT's C API; only its source
(``engines/custom_ops/kkdeploy_ops.cc``) is in git. Why fetch headers: ONNX Runtime's C/C++ API headers are
not in the pip wheels, and third-party headers are not copied into this repository. Debian trixie's
``libonnxruntime-dev`` (1.21) ships them; it is downloaded with a private apt state (a temporary source
list, lists and archive cache under our cache directory) and unpacked with ``dpkg -x``, so the system's apt
configuration and installed packages are never touched. The C API is versioned (``OrtApiBase::GetApi``), so
a library built against 1.21 headers loads in a newer runtime (checked with 1.32: docs/custom-ops.md).

For a CUDA build the library also carries the float16 CUDA EP kernels (``custom_ops/kkdeploy_ops_cuda.cu``),
compiled by ``nvcc`` with its defaults (FMA contraction on, IEEE division and square root: PyTorch's own
kernels are compiled so, and the kernels must contract as ATen's do to be bitwise) for this GPU's
architecture, and linked against cuBLASLt. The process that loads it resolves ``libcublasLt.so.13`` to the
copy already loaded (PyTorch's, in our processes), so the GEMM heuristics are PyTorch's.

Cache layout (``$KKDEPLOY_CACHE_DIR`` or ``~/.cache/kkdeploy``):
``ort-headers/<deb version>/include`` and ``custom-ops/<key>/libkkdeploy_ops.so``, where ``key`` hashes the
sources, the compiler's version, the flags, the header version and the platform. ``KKDEPLOY_ORT_INCLUDE``
names a directory holding ``onnxruntime_c_api.h`` to use instead of the download (a machine without
network: carry the cached ``include`` directory there).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from pathlib import Path

import torch

from kkdeploy.errors import KKError
from kkdeploy.kernels.cuda_build import (NVCC_FLAGS, cache_root, compiler_version, cuda_architecture, cxx_compiler,
                                         gencode, last_line, nvcc, require_gpu, run)

SOURCE_DIR = Path(__file__).resolve().parent / "custom_ops"
SOURCES = ("kkdeploy_ops.cc",)
CUDA_SOURCES = ("kkdeploy_ops_cuda.cu", "kkdeploy_ops_cuda.h", "../../kkdeploy/kernels/csrc/welford.cuh")
LIBRARY_NAME = "libkkdeploy_ops.so"
DOMAIN = "kkdeploy"
DEBIAN_SUITE = "deb http://deb.debian.org/debian trixie main"
DEBIAN_PACKAGE = "libonnxruntime-dev"
# -ffp-contract=off: no fused multiply-add, so the kernels' documented summation order is what runs.
CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-fvisibility=hidden")
BUILDER_VERSION = "2"


def compiler() -> str:
    """The C++ compiler (``cuda_build.cxx_compiler``)."""
    return cxx_compiler("the kkdeploy custom ops")


def header_api_version(include: Path) -> int:
    """``ORT_API_VERSION`` of the C API headers in ``include``: the oldest runtime the library loads in."""
    text = (include / "onnxruntime_c_api.h").read_text(errors="replace")
    match = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", text)
    if not match:
        raise KKError(f"{include / 'onnxruntime_c_api.h'} has no ORT_API_VERSION; point KKDEPLOY_ORT_INCLUDE at "
                      f"ONNX Runtime's include directory")
    return int(match.group(1))


def ort_headers() -> tuple[Path, str]:
    """``(include directory, version label)`` of ONNX Runtime's C/C++ API headers, downloaded once."""
    override = os.environ.get("KKDEPLOY_ORT_INCLUDE")
    if override:
        include = Path(override).expanduser()
        if not (include / "onnxruntime_c_api.h").is_file():
            raise KKError(f"KKDEPLOY_ORT_INCLUDE={override} has no onnxruntime_c_api.h; point it at ONNX Runtime's "
                          f"include directory (e.g. a cached ~/.cache/kkdeploy/ort-headers/*/include)")
        return include, f"api{header_api_version(include)}"
    return cached_ort_headers() or _download_headers(cache_root() / "ort-headers")


def cached_ort_headers() -> tuple[Path, str] | None:
    """``ort_headers``'s answer where an earlier build already fetched the headers into the cache, else None (nothing
    is fetched: `kkdeploy env` asks this)."""
    for done in sorted((cache_root() / "ort-headers").glob("*/include/onnxruntime_c_api.h")):
        return done.parent, done.parent.parent.name
    return None


def _download_headers(root: Path) -> tuple[Path, str]:
    """apt-get update/download with a private state directory, then dpkg -x: nothing system-wide changes."""
    from kkdeploy.console import err_console

    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise KKError(f"fetching ONNX Runtime's C API headers needs {tool} (Debian's {DEBIAN_PACKAGE}); "
                          f"set KKDEPLOY_ORT_INCLUDE to an include directory with onnxruntime_c_api.h instead")
    err_console.print(f"fetching ONNX Runtime's C API headers ({DEBIAN_PACKAGE}, Debian trixie) into {root}")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="apt-", dir=root) as tmp:
        tmp = Path(tmp)
        (tmp / "lists" / "partial").mkdir(parents=True)
        (tmp / "cache" / "archives" / "partial").mkdir(parents=True)
        (tmp / "deb").mkdir()
        (tmp / "sources.list").write_text(DEBIAN_SUITE + "\n")
        apt = ["apt-get", "-q", "-o", f"Dir::Etc::SourceList={tmp / 'sources.list'}",
               "-o", "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::State::Lists={tmp / 'lists'}",
               "-o", f"Dir::Cache={tmp / 'cache'}", "-o", "Debug::NoLocking=1"]
        if os.geteuid() == 0:  # root: download as root into our directory (apt's _apt user cannot write there)
            apt += ["-o", "APT::Sandbox::User=root"]
        for step in (apt + ["update"], apt + ["download", DEBIAN_PACKAGE]):
            proc = run(step, cwd=tmp / "deb")
            if proc.returncode != 0:
                raise KKError(f"could not fetch {DEBIAN_PACKAGE} from Debian trixie ({' '.join(step[-1:])}: "
                              f"{last_line(proc)}); check network access to deb.debian.org or set "
                              f"KKDEPLOY_ORT_INCLUDE to an include directory with onnxruntime_c_api.h")
        debs = sorted((tmp / "deb").glob(f"{DEBIAN_PACKAGE}_*.deb"))
        if not debs:
            raise KKError(f"apt-get download left no {DEBIAN_PACKAGE} package; set KKDEPLOY_ORT_INCLUDE instead")
        version = debs[0].name.split("_")[1].replace(":", "_").replace("+", "_")
        proc = run(["dpkg", "-x", str(debs[0]), str(tmp / "x")])
        include = tmp / "x" / "usr" / "include" / "onnxruntime"
        if proc.returncode != 0 or not (include / "onnxruntime_c_api.h").is_file():
            raise KKError(f"unpacking {debs[0].name} gave no onnxruntime_c_api.h ({last_line(proc)}); "
                          f"set KKDEPLOY_ORT_INCLUDE instead")
        staged = tmp / "staged"
        staged.mkdir()
        shutil.copytree(include, staged / "include")
        (staged / "package.json").write_text(json.dumps({"package": debs[0].name, "suite": DEBIAN_SUITE}))
        target = root / version
        try:
            staged.rename(target)  # atomic: a concurrent builder's complete copy wins, ours is dropped
        except OSError:
            if not (target / "include" / "onnxruntime_c_api.h").is_file():
                raise
    return target / "include", version


def library_key(cxx: str, include: Path, header_version: str, cuda: dict | None = None) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + (CUDA_SOURCES if cuda else ()):
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    for name in sorted(p.name for p in include.glob("*.h")):  # the headers compiled in, byte for byte
        digest.update(name.encode() + b"\0" + (include / name).read_bytes())
    env = {"builder": BUILDER_VERSION, "compiler": compiler_version(cxx), "flags": CXX_FLAGS,
           "headers": header_version, "platform": platform.platform(), "machine": platform.machine(),
           "cuda": cuda}
    digest.update(json.dumps(env, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def cublas_location() -> dict:
    """Where cuBLASLt's header and library are: the pip package PyTorch itself loads (``nvidia-cublas``:
    ``nvidia/cublas`` or, for CUDA 13 wheels, ``nvidia/cu13``), so the kernels link the very library the
    reference runs; else the CUDA toolkit's (nvcc's default paths)."""
    import importlib.util

    toolkit = {"include": None, "lib_dir": None, "lib": "cublasLt"}
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for root in sorted(Path(base).iterdir()):
            libs = sorted((root / "lib").glob("libcublasLt.so*"))
            if (root / "include" / "cublasLt.h").is_file() and libs:
                return {"include": str(root / "include"), "lib_dir": str(root / "lib"), "lib": f":{libs[0].name}"}
    return toolkit


def cuda_toolchain(device: torch.device) -> dict | None:
    """What a CUDA build compiles with (nvcc, its version, the flags, the architecture); None for the CPU."""
    if device.type != "cuda":
        return None
    require_gpu("the kkdeploy CUDA custom ops")
    compiler_path = nvcc()
    return {"nvcc": compiler_path, "version": compiler_version(compiler_path), "flags": list(NVCC_FLAGS),
            "arch": cuda_architecture(str(device)), "cublas": cublas_location()}


def compile_commands(cxx: str, include: Path, staged: Path, cuda: dict | None) -> list[list[str]]:
    """The commands that build ``staged``: one g++ call for the CPU library; for CUDA, nvcc compiles the
    kernels to an object, g++ compiles the ORT wrapper with the CUDA ops, and nvcc links both with cuBLASLt."""
    cc = [str(SOURCE_DIR / s) for s in SOURCES]
    if cuda is None:
        return [[cxx, *CXX_FLAGS, f"-I{include}", *cc, "-o", str(staged)]]
    arch = gencode(cuda["arch"])
    kernels, wrapper = staged.with_name("kernels.o"), staged.with_name("wrapper.o")
    host_flags = [f for f in CXX_FLAGS if f != "-shared"]
    cublas = cuda.get("cublas") or {"include": None, "lib_dir": None, "lib": "cublasLt"}
    cublas_include = [f"-I{cublas['include']}"] if cublas["include"] else []
    cublas_link = ([f"-L{cublas['lib_dir']}", "-Xlinker", f"-rpath={cublas['lib_dir']}"] if cublas["lib_dir"]
                   else []) + [f"-l{cublas['lib']}"]
    return [
        [cuda["nvcc"], *NVCC_FLAGS, "-gencode", arch, *cublas_include, "-c", str(SOURCE_DIR / CUDA_SOURCES[0]),
         "-o", str(kernels)],
        [cxx, *host_flags, "-DKKDEPLOY_WITH_CUDA", f"-I{include}", f"-I{SOURCE_DIR}", "-c", *cc, "-o", str(wrapper)],
        [cuda["nvcc"], "-shared", "-Xcompiler", "-fPIC", "-gencode", arch, str(kernels), str(wrapper),
         *cublas_link, "-o", str(staged)],
    ]


def build_library(device: torch.device | str = "cpu") -> Path:
    """The cached ``libkkdeploy_ops.so`` for this environment, compiled first when missing.

    ``device`` cpu: the CPU kernels. cuda: the CPU kernels plus the float16 CUDA EP kernels for this GPU's
    architecture (nvcc required). Raises a one-line ``KKError`` (missing compiler, headers unreachable,
    compile error) that builders record as the candidate's ``unavailable: ...`` reason."""
    device = torch.device(device)  # a bad device string fails here, in one line
    cxx = compiler()
    cuda = cuda_toolchain(device)
    include, header_version = ort_headers()
    key = library_key(cxx, include, header_version, cuda)
    target_dir = cache_root() / "custom-ops" / key
    library = target_dir / LIBRARY_NAME
    if library.is_file():
        return library
    from kkdeploy.console import err_console

    what = f"{compiler_version(cxx)}" + (f", {cuda['version']} for {cuda['arch']}" if cuda else "")
    err_console.print(f"compiling the kkdeploy custom ops ({what}, ORT headers {header_version})")
    target_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=target_dir) as tmp:
        staged = Path(tmp) / LIBRARY_NAME
        commands = compile_commands(cxx, include, staged, cuda)
        for cmd in commands:
            proc = run(cmd, timeout=600)
            if proc.returncode != 0:
                raise KKError(f"compiling the kkdeploy custom ops failed ({Path(cmd[0]).name}): {last_line(proc)}")
        (target_dir / "build.json").write_text(json.dumps({"commands": commands, "compiler": compiler_version(cxx),
                                                           "cuda": cuda, "headers": header_version,
                                                           "api_version": header_api_version(include)}, indent=1))
        os.replace(staged, library)
    return library


def build_record(library: Path) -> dict:
    """What the manifest records of a built library (``build_library``'s path): the compilers, the CUDA
    toolchain (architecture, nvcc, cuBLASLt location; None for a CPU build), the headers, the C API version."""
    info = json.loads((Path(library).parent / "build.json").read_text())
    return {k: info.get(k) for k in ("compiler", "cuda", "headers", "api_version")}


def register(session_options, library: Path | str) -> None:
    """Register the library with an ``onnxruntime.SessionOptions``; a missing file is a one-line KKError."""
    path = Path(library)
    if not path.is_file():
        raise KKError(f"custom-op library {path} is missing; rebuild the artifact (kkdeploy build)")
    session_options.register_custom_ops_library(str(path))


def graph_uses_custom_ops(model_path: Path) -> bool:
    """Whether an ONNX file imports the ``kkdeploy`` domain (read without its external weights)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return any(op.domain == DOMAIN for op in model.opset_import)
