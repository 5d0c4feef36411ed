"""Shape 14's causal attention over long rows with the scores never stored: bit-identical, proven before it runs.

The long-context path's tiled layers compute, per tile of queries, the raw fp16 Q.K^T with cuBLAS, the
reference's scale/mask/casts/softmax in ATen's block order with our CUDA kernel (``block_softmax``), and P.V with
cuBLAS. The scores go to memory and come back three times: measured on the H200, that is 0.36 s of one layer of one
sequence at S = 100,000, most of shape 14's 23.9 s. The Triton kernels in ``_scores_softmax_triton`` recompute the
scores from q and k in three passes (row max, ATen-ordered sums, probabilities chained into ``tl.dot(p, v)``) over a
whole micro-batch at once, so nothing of size S² reaches memory.

Nothing here is assumed bitwise. ``prove_scores_attention`` checks every launch against the reference's ATen
composition on tiles of the model's own attention (``attention_case``) and on the whole layer against the proven
block-kernel path (``layer_case``, which also times both): a launch runs only where a proof made in this
environment (device, torch, CUDA, Triton, this source) found 0 differing bits and it was faster than the path it
replaces (``proven_launch``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kkdeploy.errors import KKError

from .block_softmax import block_softmax_layout, kernel_covers, reference_causal_softmax
from .paths import triton_available, triton_refusal
from .proof import ProofCase, ProofRecord, kernel_environment, lookup_proof, prove_launches, remember_proof

OP = "scores_attention"
SOURCES = [Path(__file__).resolve().parent / "_scores_softmax_triton.py",
           Path(__file__).resolve().parent / "_faithful_attention_triton.py"]  # its exp and trees come from there

#: launch variants: Triton configurations of the same arithmetic (``markstein``: one correctly rounded reciprocal
#: per row and two fmas per element instead of IEEE division; ``m128``: 128-row tiles, the per-kernel shapes measured
#: fastest on the H200 (scripts/scores_softmax_tune.py); ``g2``/``g4``: two or four of ATen's warps per program in
#: the sum pass; ``strided``: that pass scores one tile per vector element instead of regrouping a wide tile).
#: Each must be proven here before it runs.
LAUNCHES: dict[str, dict] = {
    "m64w4-markstein": dict(block_m=64, num_warps=4, fast_div=True),
    "m128-markstein": dict(max_launch=dict(block_m=128, block_n=64, num_warps=4),
                           sum_launch=dict(block_m=128, num_warps=8), group=2,
                           prob_launch=dict(block_m=128, block_n=64, num_warps=8), fast_div=True),
    "m128-strided-g2-markstein": dict(max_launch=dict(block_m=128, block_n=64, num_warps=4),
                                      sum_launch=dict(block_m=128, num_warps=8), group=2, strided=True,
                                      prob_launch=dict(block_m=128, block_n=64, num_warps=8), fast_div=True),
    "m128-strided-g4-markstein": dict(max_launch=dict(block_m=128, block_n=64, num_warps=4),
                                      sum_launch=dict(block_m=128, num_warps=8, num_stages=2), group=4, strided=True,
                                      prob_launch=dict(block_m=128, block_n=64, num_warps=8), fast_div=True),
}
#: the launch an explicit ``softmax="scores-kernel"`` runs where no proof chose one
DEFAULT_LAUNCH = "m128-markstein"
#: the max pass's key splits per row block: one is enough when a launch covers a whole sequence
WHOLE_SEQUENCE_SPLIT = 1


def launch_config(launch: str) -> dict:
    if launch not in LAUNCHES:
        raise KKError(f"scores-attention launch must be one of {', '.join(LAUNCHES)}, got {launch!r}")
    return {key: (dict(value) if isinstance(value, dict) else value) for key, value in LAUNCHES[launch].items()}


def kernel_refusal(device: torch.device | str, dtype: torch.dtype, row_len: Optional[int] = None,
                   head_dim: Optional[int] = None) -> Optional[str]:
    """None when the kernels can run here for this dtype (and row length, head dim), else why not."""
    platform = triton_refusal(device, dtype, "scores-attention kernels", "ATen's block order runs",
                              triton_available)
    if platform:
        return platform
    if row_len is not None and not kernel_covers(row_len):
        return f"rows of {row_len} keys take another ATen softmax kernel than the block softmax these reproduce"
    if head_dim is not None and not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} outside 16..256"
    return None


def proof_shape(row_len: int, heads: int, head_dim: int) -> dict:
    """The op shape a proof holds for: causal rows of ``row_len`` keys, ``heads`` heads of ``head_dim``."""
    return {"row_len": int(row_len), "heads": int(heads), "head_dim": int(head_dim), "dtype": "float16"}


def proof_environment(device: torch.device | str) -> dict:
    return kernel_environment(device, OP, SOURCES, compiler="triton")


def proven_launch(device: torch.device | str, dtype: torch.dtype, row_len: int, heads: int,
                  head_dim: int) -> Optional[str]:
    """The launch a proof in this environment found bit-identical and faster than the block-kernel path, else
    None."""
    if kernel_refusal(device, dtype, row_len, head_dim):
        return None
    record = lookup_proof(proof_environment(device), OP, proof_shape(row_len, heads, head_dim))
    return record.chosen if record is not None else None


def scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     lengths: Optional[torch.Tensor] = None, launch: str = DEFAULT_LAUNCH,
                     queries: Optional[int] = None) -> torch.Tensor:
    """Causal attention context [b, H, S, Dh] of whole sequences q, k, v [b, H, S, Dh] (fp16, CUDA), in the
    reference's rounding and ATen's block-softmax order over rows of S keys. ``lengths`` [b]: each sequence's
    valid-prefix length (keys at or past it are masked for every query, as the reference masks invalid keys).
    ``queries``: compute only the first ``queries`` rows (the rest of the context is 0: rows past every sequence's
    length, which the model zeroes after out_proj anyway)."""
    from ._scores_softmax_triton import scores_softmax

    b, heads, seq_len, head_dim = q.shape
    _, tail = block_softmax_layout(seq_len)
    config = launch_config(launch)
    queries = seq_len if queries is None else int(queries)
    if queries <= 0:
        return torch.zeros_like(q)
    context = scores_softmax(q[:, :, :queries], k, v, scale, seq_len, tail, 0, True, lengths, fuse_pv=True,
                             nsplit=WHOLE_SEQUENCE_SPLIT, **config)
    if queries == seq_len:
        return context
    out = q.new_zeros(b, heads, seq_len, head_dim)
    out[:, :, :queries] = context
    return out


# -- the proof ------------------------------------------------------------------------------------------------
def reference_tile(q, k, v, scale: float, t0: int, query_tile: int, k_end: int,
                   lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """The reference's ATen composition for one causal tile: raw fp16 Q.K^T over keys [0, k_end), scale, masks,
    float32 softmax over the whole row (ATen's own kernel), cast, P.V with cuBLAS."""
    b, heads, seq_len, _ = q.shape
    t1 = min(seq_len, t0 + query_tile)
    raw = torch.matmul(q[:, :, t0:t1], k[:, :, :k_end].transpose(-2, -1)).reshape(-1, k_end)
    probs = reference_causal_softmax(raw, scale, seq_len, t0, t1 - t0, True, lengths, heads * (t1 - t0))
    return torch.matmul(probs.view(b, heads, t1 - t0, k_end), v[:, :, :k_end])


def attention_case(label: str, q, k, v, scale: float, t0: int, query_tile: int, k_end: int,
                   lengths: Optional[torch.Tensor]) -> ProofCase:
    """One tile: each launch on the tile's queries (first_query t0; the arithmetic of a row does not depend on which
    other rows share its launch) against the reference composition."""
    from ._scores_softmax_triton import scores_softmax

    seq_len = q.shape[2]
    t1 = min(seq_len, t0 + query_tile)
    _, tail = block_softmax_layout(seq_len)

    def reference():
        return reference_tile(q, k, v, scale, t0, query_tile, k_end, lengths)

    def run(launch: str):
        return scores_softmax(q[:, :, t0:t1], k[:, :, :k_end], v[:, :, :k_end], scale, seq_len, tail, t0, True,
                              lengths, fuse_pv=True, **launch_config(launch))

    return ProofCase(label, reference, run)


def layer_case(label: str, q, k, v, scale: float, query_tile: int, block_launch: str) -> ProofCase:
    """A whole layer of the sequences in q, k, v: each launch against the block-kernel path that the model runs
    otherwise (proven bit-identical to the reference by ``block_softmax``'s proof), which it is also timed against."""
    from kkdeploy.models.long_context import tiled_attention

    def reference():
        return tiled_attention(q, k, v, scale, True, None, query_tile, "aligned", "block-kernel", block_launch)

    def run(launch: str):
        return scores_attention(q, k, v, scale, None, launch)

    return ProofCase(label, reference, run)


def prove_scores_attention(device: torch.device | str, cases: list[ProofCase], row_len: int, heads: int,
                           head_dim: int, *, layer: Optional[ProofCase] = None, launches: Optional[list[str]] = None,
                           budget_s: float = 60.0, repeats: int = 3) -> ProofRecord:
    """Prove the launches on the tile ``cases`` at op shape (row_len, heads, head_dim); then, with ``layer``
    (``layer_case``), check the survivors' bits on a whole layer against the block-kernel path and time both there
    (plain calls: one call is ~0.2-0.4 s at shape 14). The fastest bit-identical launch is chosen only if it beats
    that path. The record is remembered for this process and in the on-disk cache."""
    import time

    from .proof import differing_elements
    from .timing import event_median_ms

    started = time.perf_counter()
    environment = proof_environment(device)
    shape = proof_shape(row_len, heads, head_dim)
    refusal = kernel_refusal(device, torch.float16, row_len, head_dim)
    if refusal:
        record = ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)
    elif not cases:
        record = ProofRecord(op=OP, shape=shape, environment=environment, reason="no proof cases")
    else:
        record = prove_launches(OP, shape, launches or list(LAUNCHES), cases, device, environment=environment,
                                repeats=repeats, budget_s=budget_s)
        survivors = [r for r in record.launches if r.status == "proven"]
        if layer is not None and survivors:
            device = torch.device(device)
            expected = layer.reference()
            record.cases.append(layer.label)
            for result in survivors:
                try:
                    got = layer.run(result.launch)
                except Exception as exc:  # never raised: recorded
                    result.status, result.detail = "error", f"{layer.label}: {type(exc).__name__}: {exc}"[:200]
                    continue
                differing = differing_elements(got, expected)
                del got
                result.elements += expected.numel()
                result.cases += 1
                if differing:
                    result.differing, result.status = differing, "differs"
                    result.detail = f"first difference on {layer.label}"
                    continue
                result.ms = event_median_ms(lambda: layer.run(result.launch), repeats, device)
            del expected
            survivors = [r for r in survivors if r.status == "proven"]
            record.reference_ms = event_median_ms(layer.reference, repeats, device)
            record.chosen = None
            if survivors:
                best = min(survivors, key=lambda r: r.ms)
                record.reason = (f"{len(survivors)} of {len(record.launches)} launches bit-identical on "
                                 f"{len(record.cases)} cases; on {layer.label}: fastest {best.launch} {best.ms} ms, "
                                 f"the block-kernel path {record.reference_ms} ms")
                if best.ms < record.reference_ms:
                    record.chosen = best.launch
                else:
                    record.reason += ": the block-kernel path is as fast or faster, so it runs (the same bits)"
            else:
                record.reason = f"no launch was bit-identical on {layer.label} (against the block-kernel path)"
            record.seconds = round(time.perf_counter() - started, 3)
    remember_proof(record)
    return record
