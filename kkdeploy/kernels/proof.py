"""Proof that a kernel of ours may stand in for the ATen op it replaces, here, now, at this op shape.

Why: strict FP16 is bitwise in practice (design.md §6): one differing bit inside the model grows past the rule at
the output. So a kernel runs only where it was shown bit-identical to the op it replaces on this device, with this
torch/CUDA/compiler, at the model's own op shape, and not because a table of past measurements says so.

A proof runs every launch variant of one op on a list of cases (real activations of the model being built, padded
and all-valid, and random inputs), counts the elements whose bits differ from the reference op's output, keeps the
variants with 0 differing, times them on one case and picks the fastest. It is bounded in time (``budget_s``: the
cases left when it runs out are not run, and a variant with a case not run is not proven) and says what it spent.

The record (``ProofRecord.to_dict``) goes into the build's manifest. ``ProofCache`` keeps records on disk keyed by
environment, op and op shape, so a process that finds a proof made in the same environment reuses it; an
environment that differs (another GPU, torch, CUDA, compiler, or kernel source) finds none and proves again.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kkdeploy.errors import KKError

from .precompile import compile_only
from .timing import event_median_ms

#: bump when the record's meaning changes: older cached records are then ignored
PROOF_SCHEMA = "kkdeploy-proof/1"


@dataclass(frozen=True)
class RandomInput:
    """One kind of random input a proof adds to the model's own activations (``random_like`` draws it): N(0, 1)
    values times ``scale``; each element times 2**e with e uniform in ``exponents`` (inclusive) where given; and a
    fraction ``zeros`` of the elements exact zeros, half of them -0."""
    label: str
    scale: float = 1.0
    zeros: float = 0.0
    exponents: Optional[tuple[int, int]] = None


#: the random inputs of every proof, after the model's own. A wide scale exercises large magnitudes. Zeros among an
#: MMA's products and products of very different sizes in one k-step are where two MMA instructions may align and
#: round their sums apart: the attention's 32-row launches on ``mma.sync`` differed from cuBLAS by one ulp only on
#: padded inputs, whose masked keys are zeros in P.V's k (docs/faithful-attention.md), and the model's own inputs
#: rarely hold either (a GELU's output underflows to zero only below about -5.7).
RANDOM_INPUTS = (RandomInput("x1"), RandomInput("x8", 8.0), RandomInput("x1, a quarter zeros", zeros=0.25),
                 RandomInput("x1, magnitudes 2^-12..2^3", exponents=(-12, 3)))


def random_like(t: torch.Tensor, spec: RandomInput, generator: torch.Generator) -> torch.Tensor:
    """A random tensor of ``t``'s shape, dtype and device, drawn as ``spec`` says from ``generator``."""
    v = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float32) * spec.scale
    if spec.exponents is not None:
        lo, hi = spec.exponents
        e = torch.randint(lo, hi + 1, t.shape, generator=generator, device=t.device)
        v = v * torch.exp2(e.to(torch.float32))
    if spec.zeros:
        u = torch.rand(t.shape, generator=generator, device=t.device)
        zero = torch.where(u < spec.zeros / 2, torch.full_like(v, -0.0), torch.zeros_like(v))
        v = torch.where(u < spec.zeros, zero, v)
    return v.to(t.dtype)


def differing_elements(ours: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements whose bits differ (any dtype: compared as raw bytes per element; signed zeros and NaN payloads
    count). A shape or dtype mismatch counts every element."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return max(ours.numel(), ref.numel())
    width = ref.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return int((ours.contiguous().view(view) != ref.contiguous().view(view)).sum())


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[str]:
    """Triton's installed version (a proof's environment key holds it), or None where it is not installed."""
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:  # not installed: kernels that need it are not proven here
        return None


def environment_key(device: torch.device | str, extra: Optional[dict] = None) -> dict:
    """What a proof holds for: the device, its capability, torch, CUDA and Triton, plus ``extra`` (e.g. a kernel's
    source hash and compiler). Two environments with equal keys run the same machine code."""
    device = torch.device(device)
    key = {"device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key.update({"device_name": torch.cuda.get_device_name(index),
                    "capability": list(torch.cuda.get_device_capability(index))})
    key.update(extra or {})
    return key


def key_digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class ProofCase:
    """One input set at the op's shape: ``run(launch)`` computes our kernel's output with that launch variant and
    ``reference()`` the ATen op's output on the same inputs. ``baseline`` (default: ``reference``) is what a
    compiled graph would run instead of our kernel, timed against it: where Inductor fuses the reference's
    elementwise tail into one pass, timing the eager composition would flatter our kernel."""
    label: str
    reference: Callable[[], torch.Tensor]
    run: Callable[[str], torch.Tensor]
    baseline: Optional[Callable[[], object]] = None


@dataclass
class LaunchResult:
    launch: str
    elements: int = 0
    differing: int = 0
    cases: int = 0
    ms: Optional[float] = None
    status: str = "unproven"  # "proven" (0 differing on every case), "differs", "error", "unproven"
    detail: str = ""


@dataclass
class ProofRecord:
    op: str
    shape: dict
    environment: dict
    launches: list[LaunchResult] = field(default_factory=list)
    chosen: Optional[str] = None
    reason: str = ""
    seconds: float = 0.0
    cases: list[str] = field(default_factory=list)
    schema: str = PROOF_SCHEMA
    #: the ATen op's own time on the timing case, where the proof raced it (``against_reference``)
    reference_ms: Optional[float] = None
    #: how the launches were timed (``timer``; "not recorded" in a record from before records said)
    timer: str = ""

    def __post_init__(self):
        if not self.timer:
            self.timer = environment_timer(self.environment)

    @property
    def proven(self) -> bool:
        return self.chosen is not None

    @property
    def chosen_ms(self) -> Optional[float]:
        """The chosen launch's time as the proof measured it (None where ATen runs)."""
        return next((r.ms for r in self.launches if r.launch == self.chosen), None)

    @property
    def timings(self) -> Optional[tuple[Optional[float], float]]:
        """(our chosen launch's ms or None, ATen's ms) where the proof raced ATen, else None: what a plan weighs one
        arrangement of our kernels against another with."""
        return None if self.reference_ms is None else (self.chosen_ms, self.reference_ms)

    @property
    def shape_text(self) -> str:
        """The op shape as "k=v ..." (dtype left out), for tables."""
        return " ".join(f"{k}={v}" for k, v in self.shape.items() if k != "dtype")

    @property
    def conclusive(self) -> bool:
        """Whether the record says something lasting about this environment: no launch failed to run (an error such
        as running out of memory may not happen again) and the budget did not cut the cases short."""
        return not self.reason.startswith("budget") and all(r.status != "error" for r in self.launches)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ProofRecord":
        """The record from ``to_dict`` (keys it does not know, such as a caller's ``wall_seconds``, are ignored)."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data.setdefault("timer", "not recorded")
        data["launches"] = [LaunchResult(**r) for r in data.get("launches", [])]
        return cls(**data)

    def summary(self) -> str:
        if self.proven:
            return f"{self.op} {self.shape}: {self.chosen} ({self.reason})"
        return f"{self.op} {self.shape}: unproven ({self.reason})"


#: graph replays per timed sample: a replay of one small kernel takes a few microseconds
GRAPH_REPLAYS = 20
#: the milliseconds of replays a timed repeat spans at least (``graph_replays``)
REPLAYED_MS = 0.5


def graph_replays(one_ms: float) -> int:
    """Replays per timed repeat for a graph whose one replay took ``one_ms``: enough to span ``REPLAYED_MS`` (a
    replay's own launch is then under 1% of what is timed), at most ``GRAPH_REPLAYS``. Shape 6's launches of 1-15 ms
    were replayed 20 times per repeat, 2.5 s of its 3 s attention proof, for no better figure."""
    if one_ms <= 0:
        return GRAPH_REPLAYS
    return max(1, min(GRAPH_REPLAYS, math.ceil(REPLAYED_MS / one_ms)))


#: calls of a short op captured back to back in one timed graph (``calls_per_graph``): a graph replay's own launch
#: costs the device several microseconds, as much as a launch-bound shape's op. Replayed one call per graph, every
#: op of shape 3 timed 5.5-5.7 µs on one H100 in session 46 (ours and ATen's alike, 0.1 µs apart, so the plan
#: changed from process to process: 20 or 24 launches), where another H100 had timed them 2.9-3.7 µs in session 45.
#: In one graph the calls follow each other as the compiled graph's launches do, and the replay's launch is shared.
CALLS_PER_GRAPH = 16
#: whether proofs time short ops CALLS_PER_GRAPH calls to a graph. On since session 47: on one H100, shape 3's three
#: builds from fresh caches timed ours and ATen's apart again (the rows LayerNorm 1.7 µs against 2.9, the GEMMs
#: 2.4-3.2 against 2.8-8.4) and chose the same launches, and new users' builds of shapes 1-5, 7, 11 and 12 with it
#: (seeded and own weights) shipped bitwise. Off, every op is timed one call per graph, as before.
MANY_CALLS_PER_GRAPH = True
#: an op whose one replay takes less than this is short: it is timed with CALLS_PER_GRAPH calls per graph
SHORT_OP_MS = 0.05
#: the most bytes of outputs the CALLS_PER_GRAPH calls may hold at once (each call keeps its own in the graph's pool)
CALLS_OUTPUT_BYTES = 256 << 20


def timer(device_type: str = "cuda") -> str:
    """How the proofs of this process time their launches on ``device_type``, as a proof records it
    (``ProofRecord.timer``). A cached record timed another way is proven again once (``ProofCache.get``): its bits
    still hold, but its choice was made on other clocks. A manifest's records are adopted at load whatever their
    timer (the artifact serves what its build chose)."""
    if device_type != "cuda":
        return "wall clock, one call at a time"
    if MANY_CALLS_PER_GRAPH:
        return f"{CALLS_PER_GRAPH} calls per graph under {SHORT_OP_MS} ms"
    return "1 call per graph"


def environment_timer(environment: dict) -> str:
    """``timer`` for the device a proof's environment key names (a key without one: CUDA's)."""
    return timer(environment.get("device_type", "cuda"))


def output_bytes(out) -> int:
    """Bytes of the tensors ``out`` holds (a tensor, or a tuple or list of them; 0 for anything else)."""
    if isinstance(out, torch.Tensor):
        return out.nbytes
    if isinstance(out, (tuple, list)):
        return sum(output_bytes(o) for o in out)
    return 0


def calls_per_graph(one_ms: float, out_bytes: int) -> int:
    """How many calls of an op one timed graph holds: CALLS_PER_GRAPH for a short op (one replay under
    SHORT_OP_MS) whose outputs fit CALLS_OUTPUT_BYTES that many times, else 1 (a long op's replay launch is noise);
    1 while MANY_CALLS_PER_GRAPH is off."""
    if not MANY_CALLS_PER_GRAPH or one_ms >= SHORT_OP_MS:
        return 1
    fit = CALLS_OUTPUT_BYTES // max(1, out_bytes)
    return max(1, min(CALLS_PER_GRAPH, fit))


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of one ``fn()`` on the device, after a warm-up call.

    On a GPU, ``fn`` is captured in a CUDA graph and timed by replays (CUDA events): that is how every runner calls
    these ops, and a plain call would time the host's launch path instead (a Triton launch costs ~40 us of Python,
    a cuBLAS call ~10: at the launch-bound shapes that, not the kernel, would decide). A short op is captured
    ``calls_per_graph`` times in one graph, back to back, and each replay's time is shared out between its calls.
    Where ``fn`` cannot be captured (it synchronizes), its plain calls are timed instead. Elsewhere: wall time."""
    out_bytes = output_bytes(fn())  # the warm-up (its output is not kept)
    if device.type == "cuda":
        graph = _captured(fn, device)
        if graph is not None:
            one_ms = event_median_ms(graph.replay, 1, device)
            calls = calls_per_graph(one_ms, out_bytes)
            if calls > 1:
                many = _captured(lambda: [fn() for _ in range(calls)], device)
                if many is not None:  # else the one-call graph, as before
                    graph, one_ms = many, event_median_ms(many.replay, 1, device)
                else:
                    calls = 1
            count = graph_replays(one_ms)
            replays = event_median_ms(lambda: [graph.replay() for _ in range(count)], repeats, device)
            return round(replays / (count * calls), 5)
        return event_median_ms(fn, repeats, device)
    times = []
    for _ in range(max(1, repeats)):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return round(sorted(times)[len(times) // 2], 4)


def _captured(fn: Callable[[], object], device: torch.device):
    """``fn`` as a replayable CUDA graph (warmed up on a side stream, as capture requires), or None."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(device)
        return graph
    except Exception:  # noqa: BLE001 - a call that syncs or allocates on the host cannot be captured
        torch.cuda.synchronize(device)
        return None


#: rounds in which a proof times its survivors and ATen, each round in the other order; each keeps its fastest
#: round. One round in one order let a slow start decide: a build on an H100 (session 44) timed shape 1's Q|K|V
#: tiles at 0.129, 0.041, 0.022 and 0.017 ms one after another, where the same tiles take 0.007 ms, and kept ATen
TIMING_ROUNDS = 2


def _timed_rounds(survivors, case: ProofCase, against_reference: bool, repeats: int, device: torch.device,
                  before) -> dict:
    """{launch: ms, None: ATen's ms (``against_reference``)}: each one's fastest of TIMING_ROUNDS round medians of
    ``case``, the rounds alternating the order (the first launch first, then last), so that a clock still rising,
    or another process's work ending, makes no launch look slower than it is. ``repeats`` is shared out between
    the rounds (at least one each), so a proof times about as many calls as it did in one round."""
    timed = [(r.launch, lambda launch=r.launch: case.run(launch)) for r in survivors]
    if against_reference:
        timed.append((None, case.baseline or case.reference))
    per_round = max(1, math.ceil(repeats / TIMING_ROUNDS))
    best: dict = {}
    for index in range(TIMING_ROUNDS):
        for name, fn in timed if index % 2 == 0 else timed[::-1]:
            if before and name is not None:
                before(name)
            ms = median_ms(fn, per_round, device)
            best[name] = ms if name not in best else min(best[name], ms)
    return best


#: (before, refused) for the launches proven in this context (``launch_watch``)
_WATCH: contextvars.ContextVar = contextvars.ContextVar("kkdeploy_launch_watch", default=(None, {}))


@contextmanager
def launch_watch(before: Optional[Callable[[str], None]], refused: Optional[dict[str, str]] = None):
    """Within: ``prove_launches`` calls ``before(launch)`` before it runs a launch (on a case, or to time it), so a
    proving child can name the launch that then hangs or faults it, and records each ``refused`` launch ({launch:
    reason}) as an error without running it: the launch that took a child down, not its whole op shape."""
    token = _WATCH.set((before, dict(refused or {})))
    try:
        yield
    finally:
        _WATCH.reset(token)


class CompiledAhead(Exception):
    """Raised by ``prove_launches`` inside ``precompile.parallel_compiles``: it ran each launch once on the first case
    there, which only hands the launch's compile to the pool; the proof itself runs afterwards."""


def prove_launches(op: str, shape: dict, launches: Sequence[str], cases: Sequence[ProofCase],
                   device: torch.device | str, *, environment: Optional[dict] = None,
                   timing_case: Optional[int] = None, repeats: int = 5, budget_s: float = 30.0,
                   against_reference: bool = False, timed: bool = True,
                   clock: Callable[[], float] = time.perf_counter) -> ProofRecord:
    """Run every launch on every case, compare bits with the reference, time the survivors, choose the fastest.

    A launch is proven only if it ran every case with 0 differing elements; an exception in a launch is recorded
    as ``error`` (never raised), and a launch that differed on one case is not run on the later ones (it cannot be
    proven any more). When ``budget_s`` runs out, the remaining cases are not run, and no launch that missed a case
    is proven; the first case always runs (it pays the kernels' one-off compiles). ``timing_case`` (default: the
    last case) is the case the survivors are timed on. ``against_reference``: the ATen op is timed too, and a
    bit-identical launch slower than it is not chosen (ATen gives the same bits faster). ``timed=False``: nothing is
    timed and the first survivor is chosen (a launch that runs on another stream, such as an ONNX Runtime session,
    cannot be captured for timing, and one launch leaves nothing to choose)."""
    device = torch.device(device)
    if not launches:
        raise KKError(f"proof of {op}: no launch variants to prove")
    before, refused = _WATCH.get()
    if compile_only() and cases:
        for name in launches:
            if name in refused:
                continue
            try:
                cases[0].run(name)
            except Exception:  # noqa: BLE001 - the proof's own run meets it again and records it
                pass
        raise CompiledAhead(op)
    start = clock()
    record = ProofRecord(op=op, shape=dict(shape), environment=environment or environment_key(device))
    results = {name: LaunchResult(name) for name in launches}
    for name, why in refused.items():
        if name in results:
            results[name].status, results[name].detail = "error", why
    for index, case in enumerate(cases):
        if index and clock() - start > budget_s:
            record.reason = f"budget of {budget_s:g} s spent before case {case.label!r}"
            break
        record.cases.append(case.label)
        try:
            expected = case.reference()
        except Exception as exc:  # the reference itself cannot run: nothing is proven on this case
            for result in results.values():
                result.status, result.detail = "error", f"reference failed on {case.label}: {type(exc).__name__}"
            continue
        for name, result in results.items():
            if result.status == "error" or result.differing:
                continue
            if before:
                before(name)
            try:
                got = case.run(name)
            except Exception as exc:
                result.status = "error"
                result.detail = f"{case.label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                continue
            differing = differing_elements(got, expected)
            result.elements += expected.numel()
            result.differing += differing
            result.cases += 1
            if differing and not result.detail:
                result.detail = f"first difference on {case.label}"
            del got
        del expected
    survivors = []
    for result in results.values():
        if result.status == "error":
            continue
        if result.cases == len(cases) and result.differing == 0:
            result.status = "proven"
            survivors.append(result)
        elif result.differing:
            result.status = "differs"
    if survivors and not timed:
        record.chosen = survivors[0].launch
        record.reason = (f"{len(survivors)} of {len(results)} launches bit-identical on {len(cases)} cases "
                         f"({survivors[0].elements} elements each); not timed")
    elif survivors:
        chosen_case = cases[len(cases) - 1 if timing_case is None else timing_case]
        timings = _timed_rounds(survivors, chosen_case, against_reference, repeats, device, before)
        for result in survivors:
            result.ms = timings[result.launch]
        best = min(survivors, key=lambda r: r.ms)
        record.reason = (f"{len(survivors)} of {len(results)} launches bit-identical on {len(cases)} cases "
                         f"({best.elements} elements each); fastest {best.launch} at {best.ms} ms on "
                         f"{chosen_case.label}")
        if against_reference:
            record.reference_ms = timings[None]
            record.reason += f", ATen {record.reference_ms} ms"
        if against_reference and record.reference_ms <= best.ms:
            record.reason += ": ATen is as fast or faster, so ATen runs (the same bits)"
        else:
            record.chosen = best.launch
    elif not record.reason:
        record.reason = "no launch was bit-identical on every case: " + "; ".join(
            f"{r.launch} {r.status}{f' ({r.differing} differing)' if r.differing else ''}"
            f"{f' {r.detail}' if r.status == 'error' else ''}" for r in results.values())
    record.launches = list(results.values())
    record.seconds = round(clock() - start, 3)
    return record


def cache_root() -> Path:
    return Path(os.environ.get("KKDEPLOY_CACHE_DIR") or "~/.cache/kkdeploy").expanduser() / "proofs"


class ProofCache:
    """Proof records on disk, one JSON file per (environment, op, op shape); written atomically."""

    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else cache_root()

    def path(self, environment: dict, op: str, shape: dict) -> Path:
        return self.root / f"{op}-{key_digest(environment, op, shape)}.json"

    def get(self, environment: dict, op: str, shape: dict) -> Optional[ProofRecord]:
        path = self.path(environment, op, shape)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if (data.get("schema") != PROOF_SCHEMA or data.get("environment") != environment
                or data.get("timer") != environment_timer(environment)):
            return None
        try:
            return ProofRecord.from_dict(data)
        except TypeError:
            return None

    def put(self, record: ProofRecord) -> Path:
        from kkdeploy.artifacts import write_json

        path = self.path(record.environment, record.op, record.shape)
        try:
            write_json(path, record.to_dict())
        except OSError:  # a read-only cache only costs a re-proof next time
            pass
        return path


#: (op, frozen environment, frozen shape) -> the record this process knows, or None where the default disk cache had
#: none when asked. A kernel op asks on every call it is not captured in a CUDA graph: the answer must not cost a
#: file read or a JSON hash each time (a proof written to disk by another process later is seen by the next one).
_INDEX: dict[tuple, Optional[ProofRecord]] = {}
#: id(environment) -> (the environment, its frozen form): ``kernel_environment`` hands out one dict per kernel and
#: device, so freezing it (sorting its items) happens once
_FROZEN_ENVIRONMENTS: dict[int, tuple[dict, tuple]] = {}


def _frozen(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _key(environment: dict, op: str, shape: dict) -> tuple:
    held = _FROZEN_ENVIRONMENTS.get(id(environment))
    if held is None or held[0] is not environment:
        held = (environment, _frozen(environment))
        if len(_FROZEN_ENVIRONMENTS) < 256:  # the kernels' shared environments; a stray dict is frozen each time
            _FROZEN_ENVIRONMENTS[id(environment)] = held
    return op, held[1], _frozen(shape)


def remember_proof(record: ProofRecord, cache: Optional[ProofCache] = None, persist: bool = True) -> None:
    """Keep ``record`` for this process and, when it is conclusive and ``persist``, in the on-disk cache (an
    environment fact, like a compiled kernel). An inconclusive one (a launch errored, the budget ran out) is proven
    again by the next process rather than trusted forever."""
    _INDEX[_key(record.environment, record.op, record.shape)] = record
    if persist and record.conclusive:
        (cache or ProofCache()).put(record)


def lookup_proof(environment: dict, op: str, shape: dict, cache: Optional[ProofCache] = None) -> Optional[ProofRecord]:
    """The proof of ``op`` at ``shape`` made in ``environment``: this process's first, then the disk cache's
    (``cache``, default ``$KKDEPLOY_CACHE_DIR/proofs``). The default cache is read once per key and process."""
    key = _key(environment, op, shape)
    if key in _INDEX and (_INDEX[key] is not None or cache is None):
        return _INDEX[key]
    record = (cache or ProofCache()).get(environment, op, shape)
    if record is not None or cache is None:
        _INDEX[key] = record
    return record


def forget_proofs() -> None:
    """Drop what this process knows of proofs (tests; the disk cache stays)."""
    _INDEX.clear()
    _FROZEN_ENVIRONMENTS.clear()


def source_digest(*paths: Path) -> str:
    """A short hash of a kernel's source files: an edited kernel is another kernel, with proofs of its own."""
    h = hashlib.sha256()
    for path in paths:
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _kernel_environment(device, op: str, sources: tuple, compiler: str, launches: str) -> dict:
    extra = {"kernel": op, "source": source_digest(*sources), "cases": RANDOM_INPUTS_DIGEST}
    if launches:
        extra["launches"] = launches
    if compiler == "nvcc":
        from .cuda_build import NVCC_FLAGS, compiler_version, nvcc

        try:
            version = compiler_version(nvcc())
        except KKError:
            version = None
        extra.update({"nvcc": version, "flags": list(NVCC_FLAGS)})
    return environment_key(device, extra)


def kernel_environment(device: torch.device | str, op: str, sources: Sequence[Path], compiler: str = "triton",
                       launches: str = "") -> dict:
    """The environment key of one kernel's proofs: device, torch, CUDA, Triton, the kernel's source hash and, for a
    CUDA C++ kernel (``compiler="nvcc"``), nvcc's version and flags. ``launches``: a digest of the kernel's launch
    table (``launch_table_digest``), so that a record made when a launch's settings, or the set a build proves, were
    different is not found. Computed once per device and process (the op asks on every call), and the same dict
    each time: read it, never change it."""
    return _kernel_environment(device, op, tuple(sources), compiler, launches)


def launch_table_digest(*tables) -> str:
    """A short hash of a kernel's launch variants (name -> settings) and the names a build proves: a proof's
    "proven" means these settings, and a cached record made before a tile changed or joined the build's set would
    otherwise vouch for another kernel, or leave the new tile unproven."""
    return hashlib.sha256(json.dumps(tables, sort_keys=True, default=str).encode()).hexdigest()[:16]


#: the random inputs' recipe in every proof's environment key: a record proven on other (fewer) random inputs is
#: not found, so a build or a load proves again on these
RANDOM_INPUTS_DIGEST = launch_table_digest([asdict(spec) for spec in RANDOM_INPUTS])
