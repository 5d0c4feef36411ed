"""Build cache for AOTInductor packages and the environment keys a package is tied to.

A package is machine code for one (config, dtype, device type, variant, weights) under one
torch / triton / C++ compiler; any change in those makes a new key, so a cached package is
reused only where a fresh compile would produce the same program.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

DEFAULT_CACHE_DIR = Path("~/.cache/kkdeploy/inductor")
PACKAGE_NAME = "model.pt2"
INFO_NAME = "info.json"
# Bumped whenever the builder changes what it exports or how it compiles.
BUILDER_VERSION = "1"


def cache_dir(options: dict | None = None) -> Path:
    """ctx.options["cache_dir"], else $KKDEPLOY_CACHE_DIR, else ~/.cache/kkdeploy/inductor."""
    chosen = (options or {}).get("cache_dir") or os.environ.get("KKDEPLOY_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(chosen).expanduser()


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    """First line of ``<c++> --version`` for the compiler Inductor would use ('' if none)."""
    try:
        from torch._inductor import cpp_builder

        cxx = cpp_builder.get_cpp_compiler()
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else ""
    except Exception:
        return ""


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def environment_keys(device: torch.device) -> dict:
    """What a package depends on besides its inputs; recorded in the manifest, checked at load."""
    keys = {
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version() if device.type == "cuda" else None,
        "compiler": compiler_version(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "device_name": None,
        "capability": None,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        keys["device_name"] = torch.cuda.get_device_name(index)
        keys["capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
    return keys


def cache_key(config_dict: dict, dtype_name: str, variant: str, weights_sha256: str, env: dict,
              ops_version: str) -> str:
    payload = {
        "builder": BUILDER_VERSION, "ops": ops_version, "config": config_dict, "dtype": dtype_name,
        "variant": variant, "weights_sha256": weights_sha256, "env": env,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def lookup(root: Path, key: str) -> tuple[Path, dict] | None:
    """The cached package and its build info, or None; an entry missing either file is a miss."""
    entry = root / key
    package, info = entry / PACKAGE_NAME, entry / INFO_NAME
    if not (package.is_file() and info.is_file()):
        return None
    try:
        return package, json.loads(info.read_text())
    except (OSError, ValueError):
        return None


def store(root: Path, key: str, package: Path, info: dict) -> None:
    """Publish atomically (temp dir, then rename): a reader never sees half an entry."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        shutil.copyfile(package, staging / PACKAGE_NAME)
        (staging / INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True))
        target = root / key
        if target.exists():  # a concurrent build got there first; its package is equivalent
            return
        os.replace(staging, target)
    except OSError:
        pass  # the cache is an optimisation: failing to fill it must not fail the build
    finally:
        shutil.rmtree(staging, ignore_errors=True)


