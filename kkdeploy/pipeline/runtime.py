"""`kkdeploy.load`: serve verified artifacts, or the PyTorch fallback with the reason why.

Loading checks, before any engine runs: every file's sha256, the weights hash, the manifest's
dtype and shape, the device's name and capability, and the library versions the chosen engine
was built and validated with. Any mismatch, a missing library or a failed validation serves the
fallback (OptimizedTransformer with the validated ``sdpa_layers``) and logs one line saying why.
Tampered or foreign weights cannot be served at all: that is an error, not a fallback.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engines.base import AllValidRouter, ModuleRunner, Runner, close_all
from validation.trials import DEFAULT_PADDING_RATIO

from .. import artifacts
from .chooser import FALLBACK
from ..config import TransformerConfig, parse_dtype, resolve_device, tf32_mode
from ..errors import KKError, first_line
from ..inputs import DEFAULT_SEED, check_inputs

log = logging.getLogger("kkdeploy")

REQUIRED_MANIFEST_KEYS = ("config", "dtype", "environment", "weights", "candidates", "fallback", "choice", "files")


def __getattr__(name: str):
    if name == "BACKEND_LIBRARIES":  # backend key -> the library versions its engines depend on (its descriptor's)
        from engines.registry import backend_libraries

        return backend_libraries()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ServedRunner(Runner):
    """``runner(x, valid_token_mask=None)``; ``backend`` and ``reason`` say what was loaded and why.

    What serves a call follows the manifest's choice: the engine, every call; an all-valid-only engine, all-valid
    calls, with padded ones routed (``AllValidRouter``) to the padded engine or else the PyTorch fallback; or the
    fallback alone. ``close()`` releases the engines, then the fallback model.
    """

    def __init__(self, fallback: torch.nn.Module, engine=None, backend: str = FALLBACK, reason: str = "",
                 all_valid_only: bool = False, manifest: dict | None = None, padded_engine=None):
        super().__init__(fallback.config, fallback.dtype, fallback.device)
        self.fallback = fallback
        self.engine = engine
        self.padded_engine = padded_engine  # serves padded calls when ``engine`` is all-valid-only
        self.backend = backend
        self.reason = reason
        self.all_valid_only = all_valid_only
        self.manifest = manifest or {}
        self._fallback = ModuleRunner(fallback, FALLBACK)
        self._router = (AllValidRouter(engine, padded_engine or self._fallback)
                        if engine is not None and all_valid_only else None)

    def __call__(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self._router is not None:  # checked once here; the routes' own ``__call__`` would check again
            engine = self.engine
            check_inputs(x, valid_token_mask, engine.config.d_model, engine.dtype, engine.device,
                         shape=(engine.config.batch_size, engine.config.seq_len))
        return self.infer(x, valid_token_mask)

    def infer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``mask`` may be None (all valid): the engine's call, the router and the fallback each take it so."""
        if self._router is not None:
            return self._router.infer(x, mask)
        if self.engine is not None:
            return self.engine(x, mask)
        return self._fallback.infer(x, mask)

    def static_call(self):
        """The engine's ``StaticCall`` when it serves every call (no mask routing), else None."""
        if self._router is not None or self.engine is None or self.closed:
            return None
        static = getattr(self.engine, "static_call", None)
        return static() if callable(static) else None

    def release(self) -> None:
        close_all((self._router, self.padded_engine, self.engine, self._fallback))
        self._router = self.padded_engine = self.engine = self.fallback = None

    def __repr__(self) -> str:
        return f"ServedRunner(backend={self.backend!r}, reason={self.reason!r})"


def verify_files(root: Path, manifest: dict) -> str | None:
    """The first file whose bytes differ from the manifest, as a reason; None when all match."""
    for rel, expected in manifest.get("files", {}).items():
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        if artifacts.file_sha256(path) != expected:
            return f"{rel} was modified (sha256 differs from the manifest)"
    return None


def environment_mismatch(manifest: dict, entry: dict, device: torch.device) -> str | None:
    """Why ``entry``'s engine cannot be trusted here: another device, or another version of a library it depends
    on (its backend's descriptor says which: a different version may round differently). None when it can."""
    from engines.registry import libraries

    recorded = manifest["environment"]
    here = artifacts.device_info(device)
    key = artifacts.first_difference(recorded["device"], here, ("type", "name", "capability"))
    if key is not None:
        return (f"built for device {key} {recorded['device'].get(key)!r}, this is {here.get(key)!r}; "
                f"rebuild on this machine")
    now = artifacts.library_versions()
    lib = artifacts.first_difference(recorded["versions"], now, libraries(entry["backend"]))
    if lib is not None:
        return f"built with {lib} {recorded['versions'].get(lib)}, this environment has {now.get(lib)}; rebuild"
    return None


def load_fallback(root: Path, manifest: dict, config: TransformerConfig, dtype: torch.dtype,
                  device: torch.device) -> torch.nn.Module:
    from safetensors.torch import load_file

    from ..models.optimized import OptimizedTransformer
    from ..models.weights import weights_sha256

    weights = root / manifest["weights"]["file"]
    if not weights.is_file():
        raise KKError(f"{weights} is missing; the artifacts cannot be served, rebuild them")
    try:
        state = load_file(str(weights))
    except Exception as exc:
        raise KKError(f"{weights} cannot be read ({type(exc).__name__}); rebuild the artifacts") from None
    if weights_sha256(state) != manifest["weights"]["sha256"]:
        raise KKError(f"{weights} does not match the manifest's weights hash (tampered or foreign); rebuild")
    if manifest["fallback"].get("model") == "LongContextTransformer":
        from ..models.long_context import LongContextTransformer

        model = LongContextTransformer(config, sdpa_layers=int(manifest["fallback"]["sdpa_layers"]))
    else:
        model = OptimizedTransformer(config, sdpa_layers=int(manifest["fallback"]["sdpa_layers"]))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise KKError(f"{weights} does not fit the manifest's config: {first_line(exc)}") from None
    return model.to(device=device, dtype=dtype).eval()


def adopt_long_context_proofs(root: Path, manifest: dict, model, config: TransformerConfig, dtype: torch.dtype,
                              device: torch.device) -> str:
    """The long-context model runs our kernels (the block softmax, the scores-attention kernels) only where a proof
    holds here. Proofs the build made in this same environment (manifest) are adopted; elsewhere (another GPU, torch,
    CUDA, compiler or kernel source) the kernels are proven again now, on the artifact's own weights, and the
    answers cached beside the artifacts (``proofs/``). Without a bit-identical launch the tiled layers read full key
    rows with ATen's ops: the reference's bits, slower. Returns the sentence for the runner's reason ("" when no
    kernel can run here)."""
    from ..kernels import block_softmax, scores_attention
    from ..kernels.proof import ProofCache, ProofRecord, lookup_proof, remember_proof

    if block_softmax.kernel_refusal(device, dtype) or not config.causal:
        return ""
    ops = {block_softmax.OP: (block_softmax.proof_environment(device),
                              block_softmax.proof_shape(config.seq_len, config.num_heads * model.query_tile),
                              "block-softmax kernel")}
    if scores_attention.kernel_refusal(device, dtype, config.seq_len, config.head_dim) is None:
        ops[scores_attention.OP] = (scores_attention.proof_environment(device),
                                    scores_attention.proof_shape(config.seq_len, config.num_heads, config.head_dim),
                                    "scores-attention kernels")
    recorded = {r.get("op"): r for r in manifest.get("kernel_proofs") or []}
    local = ProofCache(root / "proofs")
    adopted, missing, proven_now = {}, [], set()
    for op, (environment, shape, _) in ops.items():
        entry = recorded.get(op)
        if entry and entry.get("environment") == environment and entry.get("shape") == shape:
            try:
                adopted[op] = ProofRecord.from_dict(entry)
            except TypeError:
                adopted.pop(op, None)
            else:
                remember_proof(adopted[op], persist=False)  # the manifest keeps it: no disk write on every load
                continue
        record = lookup_proof(environment, op, shape, cache=local)
        if record is None:
            missing.append(op)
        else:
            adopted[op] = record
    if missing:
        from .long_context_plan import prove_long_context_kernels_isolated

        validation = manifest.get("validation") or {}
        for proof in prove_long_context_kernels_isolated(  # on a GPU in a child: a fault must not end the server
                model, config, dtype, device, seed=int(validation.get("seed", DEFAULT_SEED)),
                padding_ratio=float(validation.get("padding_ratio") or DEFAULT_PADDING_RATIO)):
            if proof.get("op") in missing and proof.get("environment"):
                record = ProofRecord.from_dict(proof)
                local.put(record)
                adopted[record.op] = record
                proven_now.add(record.op)
    parts = []
    for op, (_, _, name) in ops.items():
        record = adopted.get(op)
        if record is None:
            continue
        how = "proven again here at load" if op in proven_now else "the build's proof holds here"
        parts.append(f"{name}: {record.chosen} ({how})" if record.chosen
                     else f"{name} not bit-identical or not faster here ({record.reason})")
    return "; ".join(parts)


def read_manifest(root: Path) -> dict:
    if not root.is_dir():
        raise KKError(f"{root} is not a directory; pass the artifact directory written by `kkdeploy build`")
    manifest = artifacts.read_json(root / artifacts.MANIFEST)
    if manifest.get("schema") != artifacts.MANIFEST_SCHEMA:
        raise KKError(f"{root} is not a kkdeploy artifact directory (schema {manifest.get('schema')!r}); "
                      f"rebuild it with `kkdeploy build`")
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise KKError(f"{root / artifacts.MANIFEST} lacks {', '.join(missing)} (truncated or hand-edited); rebuild it")
    try:
        TransformerConfig.from_dict(manifest["config"])
        parse_dtype(manifest["dtype"])
    except (KeyError, TypeError) as exc:
        raise KKError(f"{root / artifacts.MANIFEST} has an unreadable config ({exc}); rebuild it") from None
    return manifest


class BucketedRunner:
    """``runner(x, valid_token_mask=None)`` for any batch of 1..max(buckets) sequences.

    Each bucket is a runner loaded from its own validated artifacts (``buckets/b<N>/``, the top level for the
    largest). A call runs on the smallest bucket that holds its batch; a batch smaller than that bucket is padded
    inside it with zero rows whose mask is all False (the model sets those rows to zeros, and every row is
    computed on its own), and only the caller's rows are returned. ``buckets[b]`` is each bucket's own runner,
    with its ``backend`` and ``reason``; ``run_bucket`` lets a server that already padded skip the copy."""

    def __init__(self, buckets: dict[int, object], manifest: dict | None = None):
        if not buckets:
            raise KKError("a bucketed runner needs at least one bucket")
        self.buckets = dict(sorted(buckets.items()))
        self.sizes = list(self.buckets)
        self.manifest = manifest or {}
        largest = self.buckets[self.sizes[-1]]
        self.backend = largest.backend
        self.reason = largest.reason

    @property
    def config(self) -> TransformerConfig:
        return self.buckets[self.sizes[-1]].config

    @property
    def fallback(self):
        """The PyTorch model every bucket falls back to (one set of weights for all: loading checks each bucket's
        hash against the top level's), so a bucketed runner is used as any loaded runner is (`kkdeploy run`)."""
        return self.buckets[self.sizes[-1]].fallback

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` sequences; a one-line error past the largest."""
        for size in self.sizes:
            if n <= size:
                return size
        raise KKError(f"a batch of {n} sequences exceeds the largest validated bucket ({self.sizes[-1]}); split "
                      f"the call or rebuild with a larger --batch-size")

    def run_bucket(self, size: int, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` already holds exactly ``size`` rows (padding rows masked out)."""
        return self.buckets[size](x, mask)

    def __call__(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[0] < 1:
            raise KKError(f"x must be [batch, seq_len, d_model] with batch >= 1, got {list(x.shape)}")
        n = int(x.shape[0])
        size = self.bucket_for(n)
        if n == size:
            return self.run_bucket(size, x, valid_token_mask)
        if valid_token_mask is not None and tuple(valid_token_mask.shape) != (n, x.shape[1]):
            raise KKError(f"valid_token_mask must be [{n}, {x.shape[1]}] for x of shape {list(x.shape)}, "
                          f"got {list(valid_token_mask.shape)}")
        padded = torch.zeros((size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[:n] = x
        mask = torch.zeros((size, x.shape[1]), dtype=torch.bool, device=x.device)
        mask[:n] = True if valid_token_mask is None else valid_token_mask
        return self.run_bucket(size, padded, mask)[:n]

    def close(self) -> None:
        """Close every bucket's runner, smallest first; a second call does nothing."""
        close_all(self.buckets.values())

    def __enter__(self) -> "BucketedRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BucketedRunner({', '.join(f'{b}: {r.backend}' for b, r in self.buckets.items())})"


def bucketed(runner, batch: int | None = None) -> BucketedRunner:
    """``runner`` as a BucketedRunner: itself, or an artifact without buckets as its one bucket B."""
    if isinstance(runner, BucketedRunner):
        return runner
    return BucketedRunner({int(batch or runner.config.batch_size): runner}, getattr(runner, "manifest", None))


def load(path, device=None):
    """The runner for the artifacts at ``path``: a ``ServedRunner`` at the artifact's batch, or, for artifacts built
    with ``--batch-buckets``, a ``BucketedRunner`` over every bucket (each loaded, checked and, if need be, falling
    back on its own)."""
    root = Path(path)
    manifest = read_manifest(root)
    record = manifest.get("batch_buckets") or {}
    if len(record.get("buckets") or []) > 1:
        return load_buckets(root, manifest, device)
    return load_one(root, manifest, device)


def load_buckets(root: Path, manifest: dict, device=None) -> BucketedRunner:
    """Every bucket through ``load_one`` (its own hashes, environment checks and fallback). A bucket manifest whose
    sha256 is not the one the top manifest recorded is not trusted: that bucket serves the PyTorch fallback."""
    runners = {}
    try:
        for entry in manifest["batch_buckets"]["buckets"]:
            size, rel = int(entry["batch"]), entry["dir"]
            runners[size] = runner = load_bucket(root, manifest, entry, device)
            if runner.manifest.get("weights", {}).get("sha256") != manifest["weights"]["sha256"]:
                raise KKError(f"{root / rel}: weights differ from the artifact's; rebuild the artifacts")
    except BaseException:
        close_all(runners.values())  # what was loaded before the refusal is not served: released now
        raise
    return BucketedRunner(runners, manifest)


def load_bucket(root: Path, manifest: dict, entry: dict, device=None) -> ServedRunner:
    size, rel = int(entry["batch"]), entry["dir"]
    if rel == ".":
        return load_one(root, manifest, device)
    sub = root / rel
    sub_manifest = read_manifest(sub)
    if TransformerConfig.from_dict(sub_manifest["config"]).batch_size != size:
        raise KKError(f"{sub}: its batch is not the bucket's {size}; rebuild the artifacts")
    if artifacts.file_sha256(sub / artifacts.MANIFEST) == entry.get("manifest_sha256"):
        return load_one(sub, sub_manifest, device)
    sub_manifest = {**sub_manifest, "choice": {**sub_manifest["choice"], "candidate": FALLBACK,
                                               "backend": None, "all_valid_only": False}}
    reason = f"{rel}/{artifacts.MANIFEST} differs from the one the build recorded; rebuild the artifacts"
    log.warning("kkdeploy: bucket %d serves the PyTorch fallback for %s: %s", size, root, reason)
    runner = load_one(sub, sub_manifest, device)
    runner.reason = reason
    return runner


def load_one(root: Path, manifest: dict, device=None) -> ServedRunner:
    config = TransformerConfig.from_dict(manifest["config"])
    dtype = parse_dtype(manifest["dtype"])
    recorded_type = manifest["environment"]["device"]["type"]
    if device is None:
        device = recorded_type if recorded_type == "cpu" or torch.cuda.is_available() else "cpu"
    device = resolve_device(device)
    fallback = load_fallback(root, manifest, config, dtype, device)
    choice = manifest["choice"]

    def serve_fallback(reason: str) -> ServedRunner:
        if choice["candidate"] != FALLBACK and choice.get("backend") != "long_context":
            log.warning("kkdeploy: serving the PyTorch fallback for %s: %s", root, reason)
        return ServedRunner(fallback, backend=FALLBACK, reason=reason, manifest=manifest)

    if choice.get("backend") == "long_context":
        note = adopt_long_context_proofs(root, manifest, fallback, config, dtype, device)
        served = serve_fallback(choice["reason"] + (f"; {note}" if note else ""))
        served.backend = choice["candidate"]
        return served
    if choice["candidate"] == FALLBACK:
        served = serve_fallback(choice["reason"])
        served.backend = choice["candidate"]
        return served
    problem = verify_files(root, manifest)
    if problem:
        return serve_fallback(problem)
    engine, problem = load_engine(root, manifest, choice["candidate"], config, dtype, device)
    if problem:
        return serve_fallback(problem)
    padded = None
    padded_name = choice.get("padded_candidate")
    if choice.get("all_valid_only") and padded_name not in (None, FALLBACK):
        padded, problem = load_engine(root, manifest, padded_name, config, dtype, device)
        if problem:  # the all-valid engine still serves; padded calls take the PyTorch fallback
            log.warning("kkdeploy: padded calls take the PyTorch fallback for %s: %s", root, problem)
    note = getattr(engine, "kernel_note", "")  # a kernel op not bit-identical here runs ATen: said, never silent
    return ServedRunner(fallback, engine=engine, backend=choice["candidate"],
                        reason=choice["reason"] + (f"; {note}" if note else ""),
                        all_valid_only=bool(choice.get("all_valid_only")), manifest=manifest, padded_engine=padded)


def load_engine(root: Path, manifest: dict, name: str, config: TransformerConfig, dtype: torch.dtype,
                device: torch.device):
    """``(runner, None)`` or ``(None, reason)``: checks the environment, then asks the backend."""
    entry = next((c for c in manifest["candidates"] if c["name"] == name), None)
    if entry is None:
        return None, f"the chosen candidate {name!r} is not in the manifest"
    problem = environment_mismatch(manifest, entry, device)
    if problem:
        return None, problem
    try:
        from engines import get_backend

        backend = get_backend(entry["backend"])
        if backend.loads_native_code(entry):
            problem = native_loader_problem(root, manifest, entry, config, dtype, device)
            if problem:
                return None, problem
        # The build's TF32 setting: CUDA graphs captured now keep it, whatever the caller's setting is later.
        with tf32_mode(bool(manifest.get("tf32", False))):
            return backend.load(root, entry, config, dtype, device), None
    except Exception as exc:  # a missing library, a plan the runtime rejects, ...
        return None, f"{name} could not be loaded: {type(exc).__name__}: {exc}"


PROBE_CACHE_DIR = ".fresh-process"  # beside the artifacts: one answer per candidate and environment


def native_loader_problem(root: Path, manifest: dict, entry: dict, config: TransformerConfig, dtype: torch.dtype,
                          device: torch.device) -> str | None:
    """None when ``entry``'s native loader is known to be safe in this environment, else why not.

    Known safe: the build's fresh-process check ran in this very environment and passed, or a probe here
    did (cached beside the artifacts, keyed by environment). Otherwise the engine is probed now in a spawned
    child, never in this process: a crash there costs the child, and this process serves the fallback."""
    from engines import backend_module
    from engines.base import fingerprint_padding
    from engines.fresh_process import OK, environment_key, environment_record, probe

    name = entry["name"]
    key = environment_key(environment_record(device))
    recorded = entry.get("fresh_process") or {}
    expected = recorded.get("fingerprint")
    if recorded.get("status") == OK and recorded.get("environment_key") == key:
        return None
    cache = root / PROBE_CACHE_DIR / f"{name}-{key}.json"
    answer = None
    if cache.is_file():
        try:
            answer = json.loads(cache.read_text())
        except (OSError, ValueError):
            answer = None
    if answer is None or answer.get("expected") != expected:
        all_valid_only = (entry.get("options") or {}).get("all_valid_only")
        ratios = recorded.get("padding_ratios") or fingerprint_padding(all_valid_only)
        log.warning("kkdeploy: %s was not checked in this environment; loading it in a fresh process first", name)
        outcome = probe(backend_module(entry["backend"]), root, entry, config, dtype, device,
                        tf32=bool(manifest.get("tf32", False)), padding_ratios=ratios)
        answer = {**outcome.to_dict(), "expected": expected}
        try:
            cache.parent.mkdir(exist_ok=True)
            artifacts.write_json(cache, answer)
        except OSError as exc:  # a read-only artifact directory: probe again next time
            log.warning("kkdeploy: cannot cache the probe of %s in %s: %s", name, cache.parent, exc)
    if answer["status"] != OK:
        return f"{name} was not loaded here: {answer['reason']} (probed in this environment)"
    if expected is not None and answer.get("fingerprint") != expected:
        return f"{name} was not loaded here: in a fresh process its output differs from the validated output"
    return None
