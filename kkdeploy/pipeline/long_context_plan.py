"""What the long-context build proves and validates before it ships, so that what ships is what was checked.

Two steps come before the strict validation decides:

* **The kernel proof.** Where the block-softmax kernel can run (CUDA, float16), its launch variants are checked bit
  for bit against the reference's composition on tiles of the model's own layer-0 attention (the build's weights,
  an official-style input, all-valid and padded, at the full sequence length) and on random tiles, then timed; the
  fastest bit-identical launch is what the model runs (``kkdeploy.kernels.block_softmax.prove_block_softmax``).
  No bit-identical launch: the tiled layers read full key rows with ATen's ops.
* **The validation plan.** The reduced shape (B2/S4096) is cheap, but its rows are too short to reach the key cuts
  and the block-softmax kernel (rows of 12,288 keys and more), and SDPA rounds differently at every length. So the
  plan compares the code paths a full-size call runs (``LongContextTransformer.path_features``) with those the
  reduced trials run; whatever the reduced shape misses is validated at the full sequence length on a few
  sequences. A path that no trial can exercise here (full-length trials too slow for this device) is not shipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..config import TransformerConfig
from ..inputs import generate_case
from ..models.long_context import LongContextTransformer, key_end

#: sequences of the full-length trials (two: the micro-batch loop runs more than once)
DEFAULT_FULL_LENGTH_BATCH = 2
#: full-length trials per mask mode
DEFAULT_FULL_LENGTH_TRIALS = 1
#: full-length trials estimated to take longer than this on this device are not run (the paths they would
#: exercise are then not shipped)
DEFAULT_FULL_LENGTH_BUDGET_S = 600.0
#: the reference's attention costs about this many times the path's (full key rows, unfused ATen ops)
REFERENCE_COST_FACTOR = 3.0


def full_length_config(config: TransformerConfig, batch: int = DEFAULT_FULL_LENGTH_BATCH) -> TransformerConfig:
    """The full-length validation shape: the logical sequence length on ``batch`` sequences."""
    return replace(config, batch_size=min(batch, config.batch_size))


def planned_features(model: LongContextTransformer, seq_len: int, device, dtype) -> set[str]:
    """Every code path a call on rows of ``seq_len`` may run, all-valid and padded (every tile)."""
    return (model.path_features(seq_len, False, device, dtype) | model.path_features(seq_len, True, device, dtype))


@dataclass
class ValidationPlan:
    """Which trials the build runs for one ``sdpa_layers`` choice, and why."""
    sdpa_layers: int
    full_features: list[str]
    reduced_features: list[str]
    uncovered: list[str]  # full-size paths the reduced trials do not run
    full_length: TransformerConfig | None  # the full-length trial shape, None when not needed
    feasible: bool = True
    reason: str = ""
    estimated_seconds: float | None = None

    def to_dict(self) -> dict:
        return {"sdpa_layers": self.sdpa_layers, "full_features": self.full_features,
                "reduced_features": self.reduced_features, "uncovered_by_reduced": self.uncovered,
                "full_length_shape": None if self.full_length is None else self.full_length.to_dict(),
                "feasible": self.feasible, "reason": self.reason, "estimated_seconds": self.estimated_seconds}


def trial_flops(config: TransformerConfig, runs: int) -> float:
    from .long_context import model_flops

    return model_flops(config) * runs * (1 + REFERENCE_COST_FACTOR) / 2


#: bytes the reference moves per score element of a full key row: fp16 scores, scaled, masked, float32 copy,
#: float32 softmax, fp16 probabilities, each written and read
REFERENCE_BYTES_PER_SCORE = 24


def trial_seconds(config: TransformerConfig, runs: int, rate: float, bandwidth: float) -> float:
    """A floor on ``runs`` full-length trials (the path and the reference each): the GEMM work at ``rate`` or the
    reference's score traffic at ``bandwidth``, whichever is larger (the reference reads whole key rows)."""
    scores = config.batch_size * config.num_heads * config.seq_len ** 2 * config.num_layers
    return max(trial_flops(config, runs) / max(rate, 1.0),
               runs * scores * REFERENCE_BYTES_PER_SCORE / max(bandwidth, 1.0))


def measured_copy_bandwidth(device: torch.device, seconds: float = 0.1) -> float:
    """Bytes per second a device copy of 64 MiB moves here (read + write), measured now."""
    device = torch.device(device)
    src = torch.empty(16 << 20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        dst.copy_(src)
        count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * src.numel() * 4 * count / (time.perf_counter() - start)


def plan_validation(config: TransformerConfig, validated: TransformerConfig, sdpa_layers: int, dtype, device, *,
                    query_tile: int, full_length_batch: int = DEFAULT_FULL_LENGTH_BATCH,
                    full_length_trials: int = DEFAULT_FULL_LENGTH_TRIALS,
                    budget_s: float = DEFAULT_FULL_LENGTH_BUDGET_S, rate=None, bandwidth=None) -> ValidationPlan:
    """The plan for one ``sdpa_layers``: the reduced trials, plus full-length trials when the reduced shape misses
    a path the full shape runs. ``rate`` (FLOP/s) and ``bandwidth`` (bytes/s), measured now unless given, price the
    full-length trials."""
    probe = LongContextTransformer(config, query_tile=query_tile, sdpa_layers=sdpa_layers)
    full = planned_features(probe, config.seq_len, device, dtype)
    reduced = planned_features(probe, validated.seq_len, device, dtype)
    uncovered = sorted(full - reduced)
    plan = ValidationPlan(sdpa_layers, sorted(full), sorted(reduced), uncovered, None)
    if not uncovered:
        plan.reason = f"the reduced shape (S{validated.seq_len}) runs every path the full shape runs"
        return plan
    plan.full_length = full_length_config(config, full_length_batch)
    if rate is None:
        from .long_context import measured_matmul_flops

        rate = measured_matmul_flops(torch.device(device), dtype)
    if bandwidth is None:
        bandwidth = measured_copy_bandwidth(torch.device(device))
    runs = 2 * full_length_trials  # all-valid and padded
    seconds = trial_seconds(plan.full_length, runs, rate, bandwidth)
    plan.estimated_seconds = round(seconds, 1)
    if seconds > budget_s:
        plan.feasible = False
        plan.reason = (f"the full-size call runs {', '.join(uncovered)}, which the reduced shape does not reach, and "
                       f"full-length trials ({plan.full_length.describe()}) would take ~{plan.estimated_seconds:.0f} s "
                       f"here (budget {budget_s:.0f} s)")
    else:
        plan.reason = (f"the reduced shape (S{validated.seq_len}) does not reach {', '.join(uncovered)}: validated "
                       f"at full length on {plan.full_length.batch_size} sequence(s)")
    return plan


# -- the kernel proof -----------------------------------------------------------------------------------------
def layer0_heads(model: LongContextTransformer, x: torch.Tensor, values: bool = False):
    """Layer 0's q and k [b,H,S,Dh] for input ``x`` (and v, with ``values``): what the first tiled layer
    attends with."""
    layer = model.layers[0]
    with torch.inference_mode():
        h = layer.norm1(x)
        attn = layer.attention
        q, k = attn.split_heads(attn.q_proj(h)), attn.split_heads(attn.k_proj(h))
        if values:
            return q, k, attn.split_heads(attn.v_proj(h)), attn.scale
        return q, k, attn.scale


def tile_starts(seq_len: int, query_tile: int, limit: int | None = None) -> list[int]:
    """Tiles worth proving on: the first, the first past the shortest key cut, the middle, the last, and (padded)
    the one holding the last valid query."""
    from ..models.long_context import ALIGNED_MIN_KEYS

    last = (seq_len - 1) // query_tile * query_tile
    starts = {0, min(last, ALIGNED_MIN_KEYS // query_tile * query_tile), seq_len // 2 // query_tile * query_tile,
              last}
    if limit is not None:
        starts.add((limit - 1) // query_tile * query_tile)
    return sorted(starts)


def proof_cases(model: LongContextTransformer, config: TransformerConfig, dtype, device, *, seed: int,
                padding_ratio: float, query_tile: int):
    """Tiles of the model's layer-0 attention on one full-length sequence (all-valid and padded) and random tiles,
    as ``tile_case``s; the timed case is the all-valid middle tile."""
    from ..kernels.block_softmax import tile_case

    one = replace(config, batch_size=1)
    seq_len = config.seq_len
    cases = []
    x, _ = generate_case(one, device, dtype, seed)
    q, k, scale = layer0_heads(model, x)
    for t0 in tile_starts(seq_len, query_tile):
        t1 = min(seq_len, t0 + query_tile)
        cases.append(tile_case(f"model all-valid tile {t0}", q, k, scale, t0, query_tile,
                               key_end(t1, seq_len, True, "aligned", seq_len), None))
    timing_case = next(i for i, c in enumerate(cases) if c.label.endswith(f" {seq_len // 2 // query_tile * query_tile}"))
    x, mask = generate_case(one, device, dtype, seed + 1, padding_ratio=padding_ratio)
    q, k, _ = layer0_heads(model, x)
    lengths = mask.sum(dim=1)
    limit = int(lengths.max())
    for t0 in tile_starts(seq_len, query_tile, limit):
        if t0 >= limit:
            continue
        t1 = min(seq_len, t0 + query_tile)
        cases.append(tile_case(f"model padded (length {limit}) tile {t0}", q, k, scale, t0, query_tile,
                               key_end(t1, limit, True, "aligned", seq_len), lengths))
    generator = torch.Generator(device=device).manual_seed(seed + 2)
    rq, rk = (torch.randn(q.shape, generator=generator, device=device, dtype=dtype) for _ in range(2))
    t0 = seq_len // 2 // query_tile * query_tile
    t1 = min(seq_len, t0 + query_tile)
    cases.append(tile_case(f"random tile {t0}", rq, rk, scale, t0, query_tile, key_end(t1, seq_len, True, "aligned",
                                                                                       seq_len), None))
    cases.append(tile_case(f"random padded tile {t0}", rq, rk, scale, t0, query_tile,
                           key_end(t1, t1 - 7, True, "aligned", seq_len),
                           torch.tensor([t1 - 7], device=device)))
    return cases, timing_case


def scores_proof_cases(model: LongContextTransformer, config: TransformerConfig, dtype, device, *, seed: int,
                       padding_ratio: float, query_tile: int, block_launch: str | None):
    """The scores-attention proof's cases: the block-softmax proof's tiles (the model's layer 0, all-valid and
    padded, and random tiles) as whole attention outputs against the reference composition, and, where the
    block-softmax kernel is proven (``block_launch``), one whole layer of one sequence against that path, which the
    launches are also timed against."""
    from ..kernels.scores_attention import attention_case, layer_case

    one = replace(config, batch_size=1)
    seq_len = config.seq_len
    x, _ = generate_case(one, device, dtype, seed)
    q, k, v, scale = layer0_heads(model, x, values=True)
    cases = [attention_case(f"model all-valid tile {t0}", q, k, v, scale, t0, query_tile,
                            key_end(min(seq_len, t0 + query_tile), seq_len, True, "aligned", seq_len), None)
             for t0 in tile_starts(seq_len, query_tile)]
    layer = (layer_case("model all-valid layer 0, one sequence", q, k, v, scale, query_tile, block_launch)
             if block_launch else None)
    x, mask = generate_case(one, device, dtype, seed + 1, padding_ratio=padding_ratio)
    pq, pk, pv, _ = layer0_heads(model, x, values=True)
    lengths = mask.sum(dim=1)
    limit = int(lengths.max())
    for t0 in tile_starts(seq_len, query_tile, limit):
        if t0 < limit:
            cases.append(attention_case(f"model padded (length {limit}) tile {t0}", pq, pk, pv, scale, t0, query_tile,
                                        key_end(min(seq_len, t0 + query_tile), limit, True, "aligned", seq_len),
                                        lengths))
    generator = torch.Generator(device=device).manual_seed(seed + 2)
    rq, rk, rv = (torch.randn(q.shape, generator=generator, device=device, dtype=dtype) for _ in range(3))
    t0 = seq_len // 2 // query_tile * query_tile
    t1 = min(seq_len, t0 + query_tile)
    cases.append(attention_case(f"random tile {t0}", rq, rk, rv, scale, t0, query_tile,
                                key_end(t1, seq_len, True, "aligned", seq_len), None))
    cases.append(attention_case(f"random padded tile {t0}", rq, rk, rv, scale, t0, query_tile,
                                key_end(t1, t1 - 7, True, "aligned", seq_len), torch.tensor([t1 - 7], device=device)))
    return cases, layer


def prove_long_context_kernels_isolated(model: LongContextTransformer, config: TransformerConfig, dtype, device, *,
                                        seed: int, padding_ratio: float, budget_s: float = 60.0) -> list[dict]:
    """``prove_long_context_kernels`` in a spawned child on a GPU (``kernels.proof_process``): a kernel that faults
    ends the child, and both kernels then run ATen's paths with a record saying why (the scores kernels are proven
    on the block softmax's choice, so neither is trusted alone); the build goes on. Elsewhere, in this process."""
    from ..kernels.proof_process import OK, adopt_records, isolation_wanted, run_proof_child
    from ..kernels.scores_attention import OP as SCORES_OP

    if not isolation_wanted(device):
        return prove_long_context_kernels(model, config, dtype, device, seed=seed, padding_ratio=padding_ratio,
                                          budget_s=budget_s)
    args = {"query_tile": model.query_tile, "seed": seed, "padding_ratio": padding_ratio, "budget_s": budget_s}
    outcome = run_proof_child(f"{__name__}:long_context_proof_task", model, config, dtype, device, args)
    if outcome.status != OK:
        where = f" (proving {outcome.culprit})" if outcome.culprit else ""
        reason = f"the long-context kernels' proof {outcome.reason} in a fresh process{where}, so ATen's paths run"
        return [{"op": "block_softmax", "chosen": None, "reason": reason},
                {"op": SCORES_OP, "chosen": None, "reason": reason}]
    adopt_records(outcome.answer["records"])
    return outcome.answer["records"]


def long_context_proof_task(model, config: TransformerConfig, dtype, device, args: dict, report) -> dict:
    """The child's side: the long-context model on the weights it was given, then its kernels' proofs."""
    prover = LongContextTransformer(config, query_tile=args["query_tile"], sdpa_layers=0)
    prover.load_state_dict(model.state_dict(), strict=True)
    prover = prover.to(device=device, dtype=dtype).eval()
    return {"records": prove_long_context_kernels(prover, config, dtype, device, seed=args["seed"],
                                                  padding_ratio=args["padding_ratio"], budget_s=args["budget_s"],
                                                  on_kernel=lambda op: report(op, f"proving {op}"))}


def prove_long_context_kernels(model: LongContextTransformer, config: TransformerConfig, dtype, device, *,
                               seed: int, padding_ratio: float, budget_s: float = 60.0,
                               on_kernel=None) -> list[dict]:
    """The long-context kernels' proofs at this model's op shapes, made now on its own weights: the block softmax
    (rows of S keys, heads x query tile per launch), then the scores-attention kernels (rows of S keys, H heads of
    Dh), which run instead where they are bit-identical and faster. Returns the records (``ProofRecord.to_dict``);
    where a kernel cannot run, its record's reason says why and nothing is proven. ``on_kernel(op)`` is called
    before a kernel's launches run (the proving child's progress)."""
    from ..kernels import scores_attention
    from ..kernels.block_softmax import kernel_refusal, prove_block_softmax

    device = torch.device(device)
    start = time.perf_counter()
    rows = config.num_heads * model.query_tile
    if not config.causal:
        return [{"op": "block_softmax", "chosen": None, "reason": "not causal: the kernel is for causal tiles"},
                {"op": scores_attention.OP, "chosen": None, "reason": "not causal: the kernels are for causal rows"}]
    if kernel_refusal(device, dtype):
        block = prove_block_softmax(device, [], config.seq_len, rows)
    else:
        if on_kernel:
            on_kernel("block_softmax")
        cases, timing_case = proof_cases(model, config, dtype, device, seed=seed, padding_ratio=padding_ratio,
                                         query_tile=model.query_tile)
        block = prove_block_softmax(device, cases, config.seq_len, rows, budget_s=budget_s, timing_case=timing_case)
        del cases
    first = block.to_dict()
    first["wall_seconds"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    head_dim = config.d_model // config.num_heads
    if scores_attention.kernel_refusal(device, dtype, config.seq_len, head_dim):
        scores = scores_attention.prove_scores_attention(device, [], config.seq_len, config.num_heads, head_dim)
    else:
        if on_kernel:
            on_kernel(scores_attention.OP)
        cases, layer = scores_proof_cases(model, config, dtype, device, seed=seed, padding_ratio=padding_ratio,
                                          query_tile=model.query_tile, block_launch=block.chosen)
        scores = scores_attention.prove_scores_attention(device, cases, config.seq_len, config.num_heads, head_dim,
                                                         layer=layer, budget_s=budget_s)
        del cases, layer
    second = scores.to_dict()
    second["wall_seconds"] = round(time.perf_counter() - start, 3)
    return [first, second]
