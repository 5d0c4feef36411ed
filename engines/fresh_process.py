"""Load and call a candidate in a fresh process before any process we care about trusts it.

Some loaders run native code that can kill the process that calls them: AOTInductor packages have segfaulted
on load in a fresh process on the H200 (design.md §6, docs/results.md), yet loaded fine in a process that had
already run ``torch.compile``, such as the build's own. So a build that loads an engine in its own
process proves nothing about the service that will load it. Every backend whose loader runs such
code (``Backend.loads_native_code``) is first loaded and called once here, in a *spawned* interpreter
(never forked: a fork inherits exactly the state that hides the crash) under a timeout:

* a signal becomes ``load-crashed: SIGSEGV (signal 11) in a fresh process``;
* a timeout becomes ``load-hung: no answer within N s in a fresh process`` (the child's whole process
  group is killed);
* a Python exception becomes ``load-failed: <first line>``;
* success returns the output fingerprint (``engines.base.output_fingerprint``) the child computed, which
  the build compares with its own: an engine must compute the same bytes wherever it is loaded.

The result is recorded with the environment it ran in (``environment_key``): ``kkdeploy.load`` trusts
it only in that environment and probes again (caching the answer beside the artifacts) elsewhere.

The child is ``python -m engines.fresh_process REQUEST.json RESULT.json`` with the parent's ``sys.path``,
so a backend defined outside this package (a test's) is found by its module name.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import error_summary
# signal_reason: re-exported for the probe's callers
from kkdeploy.processes import adopt_sys_path, die_with_parent, kill_group, owned_child, signal_reason  # noqa: F401

OK, CRASHED, HUNG, FAILED = "ok", "load-crashed", "load-hung", "load-failed"
DEFAULT_TIMEOUT_S = 600.0  # a CUDA engine may compile or deserialize for minutes; a hang is longer than that


@dataclass
class ProbeResult:
    status: str  # ok, load-crashed, load-hung, load-failed
    reason: str = ""
    seconds: float = 0.0
    fingerprint: str | None = None
    environment_key: str = ""
    environment: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return asdict(self)


def environment_record(device: torch.device) -> dict:
    """What decides whether a native loader behaves alike: interpreter, libraries, device."""
    from kkdeploy.artifacts import environment

    return {**environment(device), "executable": sys.executable}


def environment_key(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def probe(module: str, artifact_dir: Path, entry: dict, config: TransformerConfig, dtype: torch.dtype,
          device: torch.device, *, tf32: bool = False, padding_ratios=(0.0,),
          timeout_s: float = DEFAULT_TIMEOUT_S) -> ProbeResult:
    """Load ``entry`` with ``module``'s backend in a spawned interpreter, call it once per padding ratio on
    the fingerprint input, and say what happened. Never raises for what the child does."""
    device = torch.device(device)
    record = environment_record(device)
    key = environment_key(record)
    request = {"module": module, "artifact_dir": str(Path(artifact_dir).resolve()), "entry": entry,
               "config": config.to_dict(), "dtype": dtype_name(dtype), "device": str(device), "tf32": bool(tf32),
               "padding_ratios": list(padding_ratios), "sys_path": list(sys.path)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kkdeploy-probe-") as tmp:
        req_path, res_path, log_path = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "child.log"
        req_path.write_text(json.dumps(request))
        with open(log_path, "wb") as log, \
                owned_child("engines.fresh_process", [str(req_path), str(res_path)], log) as child:
            try:
                returncode = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(child)
                return ProbeResult(HUNG, f"{HUNG}: no answer within {timeout_s:g} s in a fresh process",
                                   round(time.perf_counter() - started, 3), None, key, record)
        seconds = round(time.perf_counter() - started, 3)
        if returncode < 0:
            return ProbeResult(CRASHED, f"{CRASHED}: {signal_reason(returncode)} in a fresh process", seconds, None,
                               key, record)
        if res_path.is_file():
            answer = json.loads(res_path.read_text())
            if answer.get("fingerprint"):
                return ProbeResult(OK, "", seconds, answer["fingerprint"], key, record)
            return ProbeResult(FAILED, f"{FAILED}: {answer.get('error', 'no output')} in a fresh process", seconds,
                               None, key, record)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.is_file() else []
        return ProbeResult(FAILED, f"{FAILED}: exit code {returncode} in a fresh process"
                           + (f" ({tail[0][:200]})" if tail else ""), seconds, None, key, record)


def _child(request_path: str, result_path: str) -> int:
    die_with_parent()
    request = json.loads(Path(request_path).read_text())
    adopt_sys_path(request["sys_path"])
    from kkdeploy.config import parse_dtype, tf32_mode

    from . import import_backend
    from .base import output_fingerprint

    try:
        backend = import_backend(request["module"])
        config = TransformerConfig.from_dict(request["config"])
        dtype, device = parse_dtype(request["dtype"]), torch.device(request["device"])
        with tf32_mode(request["tf32"]):
            runner = backend.load(Path(request["artifact_dir"]), request["entry"], config, dtype, device)
            fingerprint = output_fingerprint(runner, config, dtype, device, padding_ratios=request["padding_ratios"])
        answer = {"fingerprint": fingerprint}
    except Exception as exc:  # noqa: BLE001 - the parent records the message
        answer = {"error": error_summary(exc)}
    Path(result_path).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
