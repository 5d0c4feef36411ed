"""Compile a build's first ``torch.compile`` candidate in a child process while the build proves its kernels.

Why: a build's first Inductor compile is its costly one (on shape 6, H200, cold caches: 9.8 s; the next four took
1.5-2.9 s each, since they share its Triton kernels), and the kernel proofs of the our-kernel candidates (15 s
there) run on the main process before it compiles anything else. A child process compiles that first candidate
meanwhile, into Inductor's on-disk caches (FX graph, AOTAutograd and Triton kernels, under
``TORCHINDUCTOR_CACHE_DIR``, which a child shares with its parent), so that the build's own compile is a cache hit.

What a child compiles is what the build compiles next: the same ``CompiledRunner`` on the same weights (the
staged weights file), dtype, device and TF32 setting, stopped after the compile (no CUDA-graph capture, no call).
Nothing a child computes is trusted: the build validates what it compiled itself, and a child that fails, hangs or
has not finished in time costs only the time (the build then compiles cold, and the record says so). The graph of
our GEMMs depends on their proofs (``kernels.fused_blocks.block_plan``); a child for it starts only once the proofs
are in the on-disk proof cache.

``CompileWarmup(weights, config, dtype, device, tf32=..., workers=N)``: ``start(names)`` starts children while
fewer than ``workers`` run, ``wait(name)`` blocks until that child is done and returns its record, ``close()`` stops
what is left. The child is ``python -m engines.compile_warmup REQUEST.json RESULT.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import error_summary

from .fresh_process import kill_group

#: seconds a build waits for one child before compiling that candidate itself
DEFAULT_WAIT_S = 300.0
#: CPU cores a machine needs before a build starts a child by default
MIN_CORES = 4


def default_workers(device: torch.device, candidates: int) -> int:
    """Children a build runs by default: one, on a GPU machine with at least ``MIN_CORES`` cores and two or more
    candidates to compile; none on the CPU (a CPU compile is the build's whole job there, and CI has 2 cores).

    One, measured (H200, 16 cores, shape 6, cold caches): the first compile is the costly one (9.8 s; the other
    four took 1.5-2.9 s each, since they share its Triton kernels), and the kernel proofs (15 s) run meanwhile. Four
    children slowed the proofs to 19 s and each other's compiles to 13-14 s, and the build gained nothing."""
    if torch.device(device).type != "cuda" or candidates < 2 or (os.cpu_count() or 1) < MIN_CORES:
        return 0
    return 1


@dataclass
class WarmupRecord:
    """What one child did, for the manifest: ``status`` is running, ok, failed, timed-out or stopped."""
    name: str
    status: str = "running"
    reason: str = ""
    child_seconds: float = 0.0  # from the child's start to its end
    waited_seconds: float = 0.0  # what the build spent waiting for it
    compile_seconds: float | None = None  # the child's own compile

    def to_dict(self) -> dict:
        return asdict(self)


class CompileWarmup:
    """Child processes that compile named ``torch.compile`` candidates into the shared Inductor caches."""

    def __init__(self, weights: Path, config: TransformerConfig, dtype: torch.dtype, device: torch.device, *,
                 tf32: bool = False, workers: int = 2, wait_s: float = DEFAULT_WAIT_S,
                 child_module: str = __name__):
        """``child_module``: what ``python -m`` runs for each child (this module; a test's stand-in)."""
        self.child_module = child_module
        self.weights, self.config, self.dtype, self.device = Path(weights), config, dtype, torch.device(device)
        self.tf32, self.workers, self.wait_s = bool(tf32), max(1, int(workers)), float(wait_s)
        self.records: dict[str, WarmupRecord] = {}
        self.proof_seconds = 0.0  # kernel proofs the build ran while the first children compiled
        self._running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="kkdeploy-warmup-")

    # -- scheduling ---------------------------------------------------------------------------------------------
    def start(self, names) -> list[str]:
        """Start a child for each name not seen before while fewer than ``workers`` run; the names started. The
        others are not queued: a child started late would finish after the build got to its candidate."""
        self._pump()
        begun = []
        for name in names:
            if name not in self.records and len(self._running) < self.workers:
                self.records[name] = WarmupRecord(name)
                self._spawn(name)
                begun.append(name)
        return begun

    def _pump(self) -> None:
        """Record every child that is done."""
        for name in list(self._running):
            child = self._running[name][0]
            if child.poll() is not None:
                self._finish(name, child.returncode)

    def _spawn(self, name: str) -> None:
        folder = Path(self._tmp.name) / f"{len(self.records)}-{time.monotonic_ns()}"
        folder.mkdir()
        request = {"name": name, "weights": str(self.weights.resolve()), "config": self.config.to_dict(),
                   "dtype": dtype_name(self.dtype), "device": str(self.device), "tf32": self.tf32,
                   "sys_path": list(sys.path)}
        (folder / "request.json").write_text(json.dumps(request))
        with open(folder / "child.log", "wb") as log:
            child = subprocess.Popen([sys.executable, "-m", self.child_module, str(folder / "request.json"),
                                      str(folder / "result.json")], stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self._running[name] = (child, time.perf_counter(), folder)

    def _finish(self, name: str, returncode: int) -> None:
        child, started, folder = self._running.pop(name)
        record = self.records[name]
        record.child_seconds = round(time.perf_counter() - started, 3)
        result = folder / "result.json"
        answer = json.loads(result.read_text()) if result.is_file() else {}
        if returncode == 0 and answer.get("ok"):
            record.status, record.compile_seconds = "ok", answer.get("compile_seconds")
            return
        record.status = "failed"
        if answer.get("error"):
            record.reason = answer["error"]
        else:
            log = folder / "child.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            record.reason = f"exit code {returncode}" + (f" ({tail[0][:200]})" if tail else "")

    # -- the build's side ---------------------------------------------------------------------------------------
    def wait(self, name: str) -> WarmupRecord | None:
        """Block until ``name``'s child is done, at most ``wait_s`` seconds; its record, or None where no child
        compiled it. A child past the limit is stopped: the build compiles."""
        record = self.records.get(name)
        if record is None:
            return None
        started = time.perf_counter()
        while True:
            self._pump()
            if name not in self._running:
                break
            child = self._running[name][0]
            remaining = self.wait_s - (time.perf_counter() - started)
            if remaining <= 0:
                kill_group(child)
                self._running.pop(name)
                record.status, record.reason = "timed-out", f"not done within {self.wait_s:g} s; compiled here"
                break
            try:
                child.wait(timeout=min(remaining, 0.5))
            except subprocess.TimeoutExpired:
                pass
        record.waited_seconds = round(record.waited_seconds + time.perf_counter() - started, 3)
        return record

    def close(self) -> None:
        """Stop every child still running (the build is done or failed), and remove their files."""
        self._pump()
        for name, (child, _, _) in list(self._running.items()):
            kill_group(child)
            self.records[name].status = "stopped"
        self._running.clear()
        self._tmp.cleanup()

    def __enter__(self) -> "CompileWarmup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def summary(self) -> dict:
        """The manifest's record: workers and each child's outcome."""
        return {"workers": self.workers, "proof_seconds": self.proof_seconds,
                "children": [r.to_dict() for r in self.records.values()]}


def _child(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    for entry in reversed(request["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    from kkdeploy.config import parse_dtype, tf32_mode
    from kkdeploy.models.weights import build_models

    from .torch_compile import CompiledRunner

    try:
        config = TransformerConfig.from_dict(request["config"])
        dtype, device = parse_dtype(request["dtype"]), torch.device(request["device"])
        with tf32_mode(request["tf32"]):
            model = build_models(config, dtype, device, weights=request["weights"], sdpa_layers=0)[0]
            runner = CompiledRunner(model, config, dtype, device, name=request["name"], compile_only=True)
            answer = {"ok": True, "compile_seconds": runner.compile_seconds}
            runner.close()
    except Exception as exc:  # noqa: BLE001 - the parent records the message
        answer = {"error": error_summary(exc)}
    Path(result_path).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
