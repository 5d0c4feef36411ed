"""The proof step in a spawned interpreter: a kernel that faults takes down that process, not the build.

Why: a proof runs launches nobody has run at this op shape on this GPU before, and a Triton kernel can fault there
(session 36: an out-of-bounds shared-memory read at D = 32, compute-sanitizer's finding). A CUDA fault is sticky:
every later call in that process fails, so a build that proved in its own process lost every candidate after it,
and a server that re-proved at load died. Here the proofs run in a child (``python -m
kkdeploy.kernels.proof_process``; spawned, never forked, as ``engines.fresh_process`` loads engines), which writes
each op shape's key to a progress file before proving it and synchronizes the device first, so a fault is pinned
on the op shape whose launches ran last:

* a signal (SIGSEGV), a sticky CUDA error or a hang past the timeout: that op shape is refused ("its proof
  crashed ... in a fresh process"; ATen runs it, the same bits) and a new child proves the rest;
* a fault before any op shape was named (in the compiles ahead): once more one launch at a time, then, if it
  still has no name, every op shape left is refused with the reason;
* a Python error: a one-line ``KKError`` for the candidate, as the same error in the build's process gave.

A record proven in a child is kept in the on-disk cache as any proof is (``ProofCache``) and handed back as JSON;
the build's process then knows every record (``remember_proof``) and runs only the launches the child ran
unharmed. Where every record is known already (the build's second candidate, a cached build) nothing is spawned.
A child costs its interpreter's start (torch's import and the device's set-up: a few seconds), paid only where a
proof must run. ``KKDEPLOY_PROOF_PROCESS=0`` proves in the calling process (a study that wants one process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from kkdeploy.config import TransformerConfig, dtype_name
from kkdeploy.errors import KKError, error_summary
from kkdeploy.processes import adopt_sys_path, die_with_parent, kill_group, owned_child, signal_reason

#: the default child task: ``prove_model_kernels`` (``module:function``; a test names its own)
MODEL_KERNELS_TASK = "kkdeploy.kernels.proof_process:model_kernels_task"
#: a proof of one model's op shapes takes seconds to a minute (shape 6's compiles); a hung kernel never returns
DEFAULT_TIMEOUT_S = 300.0
#: the outcomes of one child
OK, CRASHED, FAULTED, HUNG, FAILED = "ok", "crashed", "faulted", "hung", "failed"


class DeviceFault(RuntimeError):
    """The device is in an error state (a sticky CUDA error): this process can prove nothing more."""


@dataclass
class ChildOutcome:
    """What one proving child did: ``status``, its answer (``ok``), why not (otherwise), the last op shape it named
    (``culprit``: the one whose launches ran last), and its wall seconds."""
    status: str
    answer: Optional[dict]
    reason: str
    culprit: Optional[str]
    seconds: float


#: launches a proof may refuse one by one (each took a child down) before it gives up on the children
MAX_LAUNCH_REFUSALS = 16


def isolation_wanted(device: torch.device | str) -> bool:
    """Whether proofs on ``device`` run in a child: on CUDA, unless ``KKDEPLOY_PROOF_PROCESS=0``."""
    return torch.device(device).type == "cuda" and os.environ.get("KKDEPLOY_PROOF_PROCESS", "1") != "0"


def run_proof_child(task: str, model, config: TransformerConfig, dtype: torch.dtype, device: torch.device | str,
                    args: dict, *, progress: Optional[Callable[[str], None]] = None,
                    timeout_s: float = DEFAULT_TIMEOUT_S, stall_s: Optional[float] = None) -> ChildOutcome:
    """Run ``task`` (``module:function``) on a copy of ``model`` in a spawned interpreter; never raises for what
    the child does. ``progress`` receives the child's progress messages as they come. The child is hung when it has
    not answered within ``timeout_s``, or (``stall_s``) has said nothing new for that long: a study's long proof
    gets an hour, but a kernel that never returns should not hold it for the hour."""
    from safetensors.torch import save_file

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kkdeploy-proof-") as tmp:
        tmp = Path(tmp)
        weights = tmp / "weights.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}, str(weights))
        request = {"task": task, "weights": str(weights), "config": config.to_dict(), "dtype": dtype_name(dtype),
                   "device": str(device), "args": args, "sys_path": list(sys.path)}
        paths = [tmp / name for name in ("request.json", "result.json", "progress.jsonl", "child.log")]
        paths[0].write_text(json.dumps(request))
        seen = 0
        culprit = None
        heard = started  # when the child last said something

        def follow() -> None:  # the child's progress lines since the last look
            nonlocal seen, culprit, heard
            if not paths[2].is_file():
                return
            lines = paths[2].read_text().splitlines()
            for line in lines[seen:]:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line being written; read again next time
                    break
                seen += 1
                heard = time.perf_counter()
                if entry.get("key"):
                    culprit = entry["key"]
                if entry.get("message") and progress:
                    progress(entry["message"])

        with open(paths[3], "wb") as log, \
                owned_child("kkdeploy.kernels.proof_process", [str(p) for p in paths[:3]], log) as child:
            returncode = None
            while returncode is None:
                try:
                    returncode = child.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    follow()
                    now = time.perf_counter()
                    if now - started > timeout_s or (stall_s is not None and now - heard > stall_s):
                        kill_group(child)
                        why = (f"no answer within {timeout_s:g} s" if now - started > timeout_s
                               else f"no progress for {stall_s:g} s")
                        return ChildOutcome(HUNG, None, f"hung: {why}", culprit, round(now - started, 3))
        follow()
        seconds = round(time.perf_counter() - started, 3)
        if returncode < 0:
            return ChildOutcome(CRASHED, None, f"crashed: {signal_reason(returncode)}", culprit, seconds)
        answer = json.loads(paths[1].read_text()) if paths[1].is_file() else None
        if answer is None:
            tail = paths[3].read_text(errors="replace").strip().splitlines()[-1:]
            return ChildOutcome(CRASHED, None, f"crashed: exit code {returncode}" + (f" ({tail[0][:200]})"
                                                                                       if tail else ""),
                                culprit, seconds)
        if "fault" in answer:
            return ChildOutcome(FAULTED, None, f"faulted: {answer['fault']}", answer.get("culprit", culprit),
                                seconds)
        if "error" in answer:
            return ChildOutcome(FAILED, None, answer["error"], culprit, seconds)
        return ChildOutcome(OK, answer["result"], "", culprit, seconds)


def adopt_records(records: list[dict]) -> list:
    """A child's proof records (``ProofRecord.to_dict``) known to this process from now on: the child cached the
    conclusive ones on disk, and a sibling candidate's proof finds them all without a child of its own. Entries that
    are not records (a refusal without an environment) are left alone."""
    from .proof import ProofRecord, remember_proof

    adopted = []
    for data in records:
        if "environment" in data:
            record = ProofRecord.from_dict(data)
            remember_proof(record, persist=False)
            adopted.append(record)
    return adopted


def prove_model_kernels_isolated(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device | str,
                                 kinds: Iterable[str], *, reuse: bool = True, cache_dir: Optional[Path] = None,
                                 seed: Optional[int] = None, compile_workers: Optional[int] = None,
                                 progress: Optional[Callable[[str], None]] = None,
                                 task: str = MODEL_KERNELS_TASK, timeout_s: float = DEFAULT_TIMEOUT_S,
                                 isolate: Optional[bool] = None, launches: Optional[dict[str, list[str]]] = None,
                                 stall_s: Optional[float] = None):
    """``model_proofs.prove_model_kernels`` with its launches run in a child (``isolate``: default on CUDA), the op
    shapes whose proof took a child down refused; returns a ``ModelProofs`` as the in-process proof does.
    ``launches`` ({kind: names}): the variants to prove instead of a build's (a study of every tile). ``timeout_s``
    and ``stall_s``: when a child counts as hung (``run_proof_child``)."""
    from .model_proofs import (LAUNCH_SEP, ModelProofs, _environment, _op, kernel_op_shapes, op_key,
                               prove_model_kernels)
    from .proof import ProofCache, lookup_proof

    device = torch.device(device)
    cache = ProofCache(cache_dir) if cache_dir is not None else None
    kinds = list(kinds)
    options = {"seed": seed} if seed is not None else {}
    if compile_workers is not None:
        options["compile_workers"] = compile_workers
    if launches is not None:
        options["launches"] = launches
    if not (isolation_wanted(device) if isolate is None else isolate):
        return prove_model_kernels(model, config, dtype, device, kinds, reuse=reuse, cache=cache, progress=progress,
                                   **options)
    shapes = kernel_op_shapes(config, kinds, launches)
    if reuse and all(lookup_proof(_environment(k, device, n, s), _op(k, n), s, cache=cache) is not None
                     for k, n, s in shapes):
        return prove_model_kernels(model, config, dtype, device, kinds, cache=cache, progress=progress,
                                   launches=launches)
    start = time.perf_counter()
    refusals: dict[str, str] = {}
    workers = compile_workers  # None: the default, compiles ahead on a pool
    children = []
    answer = None
    while answer is None:
        # each death refuses one more op shape or launch: more is a child that cannot run
        if len(children) > len(shapes) + 1 + MAX_LAUNCH_REFUSALS:
            raise KKError(f"the kernel proof's process died {len(children)} times ({outcome.reason}); prove with "
                          f"KKDEPLOY_PROOF_PROCESS=0 to see where")
        args = {"kinds": kinds, "reuse": reuse, "refusals": refusals, "cache_dir": None if cache_dir is None
                else str(cache_dir), "compile_workers": workers, "seed": seed, "launches": launches}
        outcome = run_proof_child(task, model, config, dtype, device, args, progress=progress, timeout_s=timeout_s,
                                  stall_s=stall_s)
        children.append(outcome.seconds)
        if outcome.status == OK:
            answer = outcome.answer
        elif outcome.status == FAILED:
            raise KKError(f"the kernel proof failed in a fresh process: {outcome.reason}")
        elif outcome.culprit and outcome.culprit not in refusals:
            launch = outcome.culprit.partition(LAUNCH_SEP)[2]
            refusals[outcome.culprit] = (
                f"it {outcome.reason} in a fresh process, so it does not run here" if launch
                else f"its proof {outcome.reason} in a fresh process, so ATen runs it (the same bits)")
            if progress:  # a study's log says what was refused, and why, before the next child starts
                progress(f"refused {outcome.culprit}: {refusals[outcome.culprit]}")
        elif workers != 0:  # no op shape named yet (the compiles ahead): once more, one launch at a time
            workers = 0
        else:
            reason = f"the proof {outcome.reason} in a fresh process before naming an op shape, so ATen runs it"
            refusals.update({op_key(k, s): reason for k, _, s in shapes if op_key(k, s) not in refusals})
    records = adopt_records(answer["records"])
    reused = set(answer.get("reused", ()))
    proofs = ModelProofs(records, round(time.perf_counter() - start, 3),
                         [r for i, r in enumerate(records) if i in reused], dict(answer.get("phases") or {}))
    # the children's starts, and the proofs of those that died: what proving in a fresh process cost on top
    proofs.phases["processes"] = round(sum(children) - float(answer.get("seconds") or 0.0), 3)
    return proofs


def model_kernels_task(model, config: TransformerConfig, dtype: torch.dtype, device: torch.device, args: dict,
                       report: Callable[[str, Optional[str]], None]) -> dict:
    """The child's side of ``prove_model_kernels_isolated``."""
    from .model_proofs import DEFAULT_WORKERS, prove_model_kernels
    from .proof import ProofCache

    workers = args.get("compile_workers")
    seed = {"seed": args["seed"]} if args.get("seed") is not None else {}
    proofs = prove_model_kernels(
        model, config, dtype, device, args["kinds"], reuse=args.get("reuse", True),
        cache=ProofCache(Path(args["cache_dir"])) if args.get("cache_dir") else None,
        progress=lambda message: report(None, message), on_op=lambda key: report(key, None),
        on_launch=lambda key: report(key, None),
        refusals=args.get("refusals") or None, compile_workers=DEFAULT_WORKERS if workers is None else workers,
        launches=args.get("launches"), **seed)
    reused = {id(r) for r in proofs.reused_records}
    return {"records": proofs.to_list(), "reused": [i for i, r in enumerate(proofs.records) if id(r) in reused],
            "seconds": proofs.seconds, "phases": proofs.phases}


def synchronize(device: torch.device) -> None:
    """Wait for the device; a sticky CUDA error becomes ``DeviceFault``."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - whatever the driver said, this process can prove nothing more
            raise DeviceFault(error_summary(exc)) from exc


def _child(request_path: str, result_path: str, progress_path: str) -> int:
    die_with_parent()
    request = json.loads(Path(request_path).read_text())
    adopt_sys_path(request["sys_path"])
    import importlib

    from kkdeploy.config import parse_dtype
    from kkdeploy.models.reference import ReferenceTransformer
    from kkdeploy.models.weights import read_state_dict

    config = TransformerConfig.from_dict(request["config"])
    dtype, device = parse_dtype(request["dtype"]), torch.device(request["device"])
    last: list[Optional[str]] = [None]
    progress = open(progress_path, "a", encoding="utf-8")

    def report(key: Optional[str], message: Optional[str]) -> None:
        if key is not None:
            synchronize(device)  # a fault of the op shape before this one surfaces here, pinned on it
            last[0] = key
        progress.write(json.dumps({"key": key, "message": message}) + "\n")
        progress.flush()

    try:
        module, _, function = request["task"].partition(":")
        task = getattr(importlib.import_module(module), function)
        model = ReferenceTransformer(config)
        model.load_state_dict(read_state_dict(request["weights"]), strict=True)
        model = model.to(device=device, dtype=dtype).eval()
        result = task(model, config, dtype, device, request["args"], report)
        synchronize(device)
        answer = {"result": result}
    except DeviceFault as exc:
        answer = {"fault": str(exc), "culprit": last[0]}
    except Exception as exc:  # noqa: BLE001 - the parent records the message
        try:
            synchronize(device)
            answer = {"error": error_summary(exc)}
        except DeviceFault as fault:
            answer = {"fault": str(fault), "culprit": last[0]}
    Path(result_path).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:4]))
