"""Compile a build's ``torch.compile`` candidates in child processes first, so the build's own compiles hit warm caches.

Why: a build compiles its Inductor candidates one after another, and Inductor's code generation is single-threaded
Python. On shape 6 (B = 10000, H200, cold caches) five compiles took about 50 of a 78 s build. The same compiles run
side by side in child processes fill Inductor's on-disk caches (FX graph, AOTAutograd and Triton kernels, under
``TORCHINDUCTOR_CACHE_DIR``, which children share with their parent), so that the build's own compile of each is a
cache hit of a few seconds.

What a child compiles is what the build compiles next: the same ``CompiledRunner`` on the same weights (the
staged weights file), dtype, device and TF32 setting, stopped after the compile (no CUDA-graph capture, no call).
Nothing a child computes is trusted: the build validates what it compiled itself, and a child that fails, hangs or
has not finished in time costs only the time (the build then compiles cold, and the record says so). The graph of
our GEMMs depends on their proofs (``kernels.fused_blocks.block_plan``), so its child starts once the proofs are in
the on-disk proof cache.

``CompileWarmup(weights, config, dtype, device, tf32=..., workers=N)``: ``start(names)`` queues children (at most
``workers`` at once), ``wait(name)`` blocks until that child is done and returns its record, ``close()`` stops what
is left. The child is ``python -m engines.compile_warmup REQUEST.json RESULT.json``.
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
#: CPU cores each concurrent child is given in the default worker count (Inductor compiles Triton kernels in a
#: worker pool of its own)
CORES_PER_WORKER = 4


def default_workers(device: torch.device, candidates: int) -> int:
    """Children a build runs at once by default: none on the CPU (a CPU compile is the build's whole job there,
    and CI has 2 cores), else one per ``CORES_PER_WORKER`` cores, at most one per candidate; none for fewer than two
    candidates (one compile gains nothing from a child)."""
    if torch.device(device).type != "cuda" or candidates < 2:
        return 0
    return max(0, min(candidates, (os.cpu_count() or 1) // CORES_PER_WORKER))


@dataclass
class WarmupRecord:
    """What one child did, for the manifest: ``status`` is ok, failed, timed-out, stopped or queued."""
    name: str
    status: str = "queued"
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
        self._queue: list[str] = []
        self._running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="kkdeploy-warmup-")

    # -- scheduling ---------------------------------------------------------------------------------------------
    def start(self, names) -> None:
        """Queue a child for each name not queued before; children start while fewer than ``workers`` run."""
        for name in names:
            if name not in self.records:
                self.records[name] = WarmupRecord(name)
                self._queue.append(name)
        self._pump()

    def _pump(self) -> None:
        for name in list(self._running):
            child = self._running[name][0]
            if child.poll() is not None:
                self._finish(name, child.returncode)
        while self._queue and len(self._running) < self.workers:
            self._spawn(self._queue.pop(0))

    def _spawn(self, name: str) -> None:
        folder = Path(self._tmp.name) / f"{len(self.records)}-{len(self._running)}-{time.monotonic_ns()}"
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
        self.records[name].status = "running"

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
        """Block until ``name``'s child is done (started now if it was still queued), at most ``wait_s`` seconds;
        its record, or None where no child was asked for. A child past the limit is stopped: the build compiles."""
        record = self.records.get(name)
        if record is None:
            return None
        if name in self._queue:  # the build got here first: start it now, beside what runs
            self._queue.remove(name)
            self._spawn(name)
        started = time.perf_counter()
        while True:
            self._pump()  # finishes every child that is done (this one too) and starts queued ones
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
        self._pump()
        return record

    def close(self) -> None:
        """Stop every child still running or queued (the build is done or failed), and remove their files."""
        for name, (child, _, _) in list(self._running.items()):
            kill_group(child)
            self.records[name].status = "stopped"
        self._running.clear()
        for name in self._queue:
            self.records[name].status, self.records[name].reason = "stopped", "never started"
        self._queue.clear()
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
