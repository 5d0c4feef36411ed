"""``kkdeploy_faithful::qkv_attention``: the attention of a block from its normalized rows, Q, K and V projected
inside the attention's launch (``_qkv_attention_triton`` says what the launch computes and why).

The op is the reference's ATen composition (the model's q_proj, k_proj and v_proj, then ``reference_attention``)
except where a proof made in this environment found a launch bit-identical at the call's shape: then that launch.
A build proves it beside the GEMMs (``model_proofs``, the "linear" kind, where the model also runs the attention
kernel), and ``fused_blocks.block_plan`` takes it only where the proof's time is below the two launches it replaces
by their own proofs' times (the packed Q|K|V GEMM and the attention).

On an H100 (sessions 43-44, ``scripts/qkv_attention_study.py``, weights of our own) every form was bit-identical
to ATen's composition on shapes 3, 12 and 6 (first and last block, all-valid and padded, random inputs). With
dependent launches, in a CUDA graph: shape 3 6.6-6.9 µs ("whole") against 8.3-9.0 for the two launches, shape 12
5.4 against 5.9-6.1; shape 6 1.30 ms ("pair", one program per head) against 1.74 for the two launches and 1.91 for
"whole". This module imports only torch; Triton is imported where the launch runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from kkdeploy.errors import KKError

from .faithful_attention import reference_attention
from .paths import triton_available, triton_refusal
from .proof import (ProofCache, ProofCase, ProofRecord, kernel_environment, launch_table_digest, lookup_proof,
                    prove_launches, remember_proof)

OP_NAME = "kkdeploy_faithful::qkv_attention"
#: the proofs' op name
OP = "qkv_attention"
SOURCES = (Path(__file__).resolve().with_name("_qkv_attention_triton.py"),
           Path(__file__).resolve().with_name("_faithful_attention_triton.py"))  # its softmax's jit functions
#: the launch's forms (``triton_qkv_attention``'s keywords): each projection on its own, 64 keys at a time as the
#: causal limit needs them ("split"), or q, k and v in one walk over D with every key ("whole": the faster of the
#: two on shapes 3 and 12 in session 43), or one program per head that projects every row once and attends both
#: row blocks in turn ("pair": no key projected twice, half the programs; the fastest where rows outgrow the
#: launch count, shape 6 in session 44). Both load the head's biases before the walk over D (``early``: in flight
#: with its first loads instead of after its last dot; session 45, with the GEMM tiles' early loads: bit-identical in
#: builds and benches, shape 3 faster)
LAUNCHES: dict[str, dict] = {"split": {}, "whole": {"whole": True, "early": True},
                             "pair": {"pair": True, "early": True},
                             # "whole" at 8 warps (session 48; in builds since session 49): where launches bound
                             # (shape 3: 32 programs), each thread's share of the softmax halves. Offline (Triton
                             # 3.6.0, sm_90a): 2,079 SASS instructions a thread against 3,174 at 4 warps, 116
                             # registers, no spills, but ptxas serializes its wgmma and it has 46 barriers against
                             # 20. On an H100 (session 49) slower than "whole" on the launch-bound shapes, but the
                             # fastest form on shape 9's one head of 128 (12.4 µs against 28.9), where the plan
                             # took it over the two launches
                             "whole_w8": {"whole": True, "early": True, "num_warps": 8},
                             # "whole" with the keys' validity loaded before the walk over D (session 48; in
                             # builds since session 49): compiled for sm_90a, "whole" loads each 32-key chunk's
                             # validity after the projections, one round trip to L2 before the scores can be
                             # masked, twice a row block at S = 128 (a bench's timed input always has a mask). On
                             # an H100 (session 49) shape 3's form at 7.1 µs against "whole"'s 7.2-7.5
                             "whole_em": {"whole": True, "early": True, "early_mask": True},
                             # "whole_em" with each chunk pair's P.V as one 64-key dot, V never split into its
                             # 32-key chunks (session 49; in builds since session 50): offline (Triton 3.6.0,
                             # sm_90a, ``scripts/offline_ptx.py --layouts --sass``) 14 barriers against 20, 7 layout
                             # conversions against 11 and 3,046 SASS instructions a thread against 3,158, the same
                             # 64 exps. The same k16 MMAs in key order on the tensor cores; Triton's interpreter
                             # sums a dot in numpy's order, so only the GPU's proof can vouch for its bits
                             "whole_pv": {"whole": True, "early": True, "early_mask": True, "pv64": True},
                             # "pair" at 8 warps with both row blocks attended as one 128-row tile (session 50,
                             # studies only): each warpgroup holds one row block's wgmma rows, so the blocks'
                             # softmaxes run side by side in one program per head, and every key is projected once
                             # (the first block's rows also score the second block's keys: -inf, +0 exps, +0
                             # products). Offline (Triton 3.6.0, sm_90a): 2,696 SASS instructions a thread (2,631
                             # with P.V over 64 keys) against "whole_pv"'s 3,046 at 4 warps, 14-16 barriers,
                             # 117-122 registers, no spills; half the programs of "whole", each 8 warps. On an H100
                             # (session 51) bit-identical on every case of shapes 3 and 12, and slower: 7.43 and 7.00
                             # µs against "whole_pv"'s 6.82 (shape 3), 7.24 and 7.26 against 5.40 (shape 12)
                             "pair128_w8": {"pair": True, "early": True, "rows128": True, "num_warps": 8},
                             "pair128_pv_w8": {"pair": True, "early": True, "rows128": True, "pv64": True,
                                               "num_warps": 8}}
#: the forms a build proves, each shipped by a GPU build through strict validation first (H100s):
#: - "whole" (session 43): a new user's build of shape 3 proved it at 8.3 µs against the packed Q|K|V GEMM's 3.8 and
#:   the attention's 7.1, took it, and served a padded run with 0 failed elements; `-gemms-pdl` 0.0827 ms against
#:   0.0897 without it (two bench processes back to back);
#: - "pair" (session 44): a new user's build of shape 6 proved it at 1.320 ms against "whole"'s 1.934 (the two
#:   launches it replaces: 0.624 + 1.185), took it, and shipped at 11.95 ms; its padded run failed 0 of 163,840,000
#:   elements. Shape 6 13.70 -> 12.03 ms, shape 5 0.2245 -> 0.1932 ms (`-gemms-pdl`; one bench process each, back
#:   to back on one machine). Where launches bound (shape 3) "whole" is the faster, and the proof picks per shape.
#: - "whole_w8" and "whole_em" (session 49): new users' builds of shapes 3 (own weights) and 2 (seeded) proved
#:   "whole_em" at 7.1 and 6.1 µs against "whole"'s 7.5 and 6.3, took it, and served padded runs with 0 failed
#:   elements; the bench of shape 9 shipped "whole_w8", 0 failed on every trial (docs/faithful-attention.md).
#: - "whole_pv" (session 50): proven bit-identical on shapes 3 and 2, the random inputs included, at 6.85 and 5.85 µs
#:   against "whole_em"'s 7.05 and 6.09; a new user's build of shape 3 (own weights) took it and served a padded
#:   run with 0 failed elements. End to end (session 51, shape 3, ``whole_pv_leaves_builds.sh``): `-gemms-pdl`
#:   0.0667 and 0.0659 ms with it, 0.0676 without.
#: "split" was slower than "whole" wherever both ran, so a build does not spend a compile on it; studies still
#: name it
BUILD_LAUNCHES: tuple[str, ...] = ("whole", "pair", "whole_w8", "whole_em", "whole_pv")
#: the forms for launches whose programs (one per head and 64-row block) fill at most this many waves of the
#: multiprocessors: a build proves them only there (``launch_pays``). On an H100 (session 49) "whole_w8" and
#: "whole_em" won at 32-256 programs (shapes 2, 3, 4, 9) and lost to "pair" at 512 and more (shapes 1, 5, 7: 20.2 and
#: 16.0 µs against 10.4 at shape 1), where they cost a build two compiles and their proofs on every case. "whole_pv"
#: is "whole_em" with its P.V joined, proven and timed only where "whole_em" won (session 50)
LAUNCH_BOUND_FORMS, LAUNCH_BOUND_MAX_WAVES = ("whole_w8", "whole_em", "whole_pv"), 2
LAUNCHES_DIGEST = launch_table_digest(LAUNCHES, BUILD_LAUNCHES, LAUNCH_BOUND_FORMS, LAUNCH_BOUND_MAX_WAVES)
#: the rows it takes: ATen's WARP is 32 lanes from S = 17 on, and four chunks of 32 keys hold S = 128
MIN_SEQ_LEN, MAX_SEQ_LEN = 17, 128
#: the head dims it was compiled and proven for (the attention kernel's cached launch takes up to 128)
MAX_HEAD_DIM = 128


def qkv_attention_refusal(seq_len: int, d_model: int, num_heads: int) -> Optional[str]:
    """Why the launch cannot take rows of ``seq_len`` at width ``d_model`` with ``num_heads`` heads (one line), or
    None."""
    if not MIN_SEQ_LEN <= seq_len <= MAX_SEQ_LEN:
        return (f"the Q|K|V attention launch takes {MIN_SEQ_LEN} to {MAX_SEQ_LEN} keys (ATen's 32 lanes, four chunks "
                f"in registers), got S = {seq_len}: use the attention launch on packed Q|K|V")
    if num_heads < 1 or d_model % num_heads:
        return f"d_model {d_model} does not split into {num_heads} heads"
    if d_model // num_heads > MAX_HEAD_DIM:
        return f"the Q|K|V attention launch takes head dims up to {MAX_HEAD_DIM}, got {d_model // num_heads}"
    return None


def kernel_refusal(seq_len: int, d_model: int, num_heads: int, dtype: torch.dtype, device) -> Optional[str]:
    """None when the launch can run a model of this shape here (proven or not), else why not."""
    return (triton_refusal(device, dtype, "Q|K|V attention launches", "the reference composition runs",
                           triton_available) or qkv_attention_refusal(seq_len, d_model, num_heads))


def proof_shape(batch_size: int, seq_len: int, d_model: int, num_heads: int, causal: bool = True) -> dict:
    """The op shape a proof holds for."""
    return {"batch": int(batch_size), "seq_len": int(seq_len), "d_model": int(d_model), "heads": int(num_heads),
            "causal": bool(causal), "dtype": "float16"}


def launch_pays(launch: str, shape: dict, sms: Optional[int]) -> bool:
    """Whether a build proves ``launch`` at op shape ``shape`` (``proof_shape``) on a device of ``sms``
    multiprocessors: the launch-bound forms (``LAUNCH_BOUND_FORMS``) only where the launch's programs fill at most
    ``LAUNCH_BOUND_MAX_WAVES`` waves; every other form everywhere. Unknown multiprocessors (None) rule nothing out."""
    if launch not in LAUNCH_BOUND_FORMS or sms is None:
        return True
    programs = shape["batch"] * shape["heads"] * -(-shape["seq_len"] // 64)
    return programs <= LAUNCH_BOUND_MAX_WAVES * sms


def proof_environment(device: torch.device | str) -> dict:
    """The environment key of the launch's proofs (device, torch, CUDA, Triton, the kernels' source)."""
    return kernel_environment(device, OP, SOURCES, launches=LAUNCHES_DIGEST)


def reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads: int, causal: bool):
    """The reference's ops: three Linears of ``h``, then the attention composition; [B, S, D]."""
    return reference_attention(F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv), valid_token_mask,
                               num_heads, causal)


def run_launch(h, weights, biases, valid_token_mask, num_heads: int, causal: bool, launch: str) -> torch.Tensor:
    """The launch in one of LAUNCHES' forms (no path rule: what a proof runs)."""
    if launch not in LAUNCHES:
        raise KKError(f"unknown Q|K|V attention launch {launch!r}; the launches are {', '.join(LAUNCHES)}")
    from ._qkv_attention_triton import triton_qkv_attention

    return triton_qkv_attention(h, weights, biases, valid_token_mask, num_heads, causal, **LAUNCHES[launch])


def proven_record(batch_size: int, seq_len: int, d_model: int, num_heads: int, causal: bool, dtype: torch.dtype,
                  device) -> Optional[ProofRecord]:
    """This environment's proof of the launch at this shape (None: none made, or the launch cannot run here)."""
    if kernel_refusal(seq_len, d_model, num_heads, dtype, device):
        return None
    return lookup_proof(proof_environment(device), OP, proof_shape(batch_size, seq_len, d_model, num_heads, causal))


def proven_ms(batch_size: int, seq_len: int, d_model: int, num_heads: int, causal: bool, dtype: torch.dtype,
              device) -> Optional[tuple]:
    """(our chosen form's ms or None, ATen's ms) from the proof made here at this shape; None without a timed proof."""
    record = proven_record(batch_size, seq_len, d_model, num_heads, causal, dtype, device)
    return None if record is None else record.timings


@torch.library.custom_op(OP_NAME, mutates_args=())
def _qkv_attention_op(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor,
                      bk: torch.Tensor, bv: torch.Tensor, valid_token_mask: Optional[torch.Tensor], num_heads: int,
                      causal: bool) -> torch.Tensor:
    """Default (CPU and any non-CUDA device): the reference composition itself."""
    return reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal)


@_qkv_attention_op.register_kernel("cuda")
def _qkv_attention_cuda(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal):
    """CUDA: the launch a proof made here chose for this shape, else the composition."""
    b, s, d = h.shape
    record = proven_record(b, s, d, num_heads, causal, h.dtype, h.device)
    if record is not None and record.proven:
        return run_launch(h, (wq, wk, wv), (bq, bk, bv), valid_token_mask, num_heads, causal, record.chosen)
    return reference_qkv_attention(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal)


@_qkv_attention_op.register_fake
def _qkv_attention_fake(h, wq, wk, wv, bq, bk, bv, valid_token_mask, num_heads, causal):
    """Shapes only: the context is [B, S, D] like h."""
    return torch.empty_like(h, memory_format=torch.contiguous_format)


def qkv_attention(h: torch.Tensor, attention, valid_token_mask=None) -> torch.Tensor:
    """The context [B, S, D] of the reference ``Attention`` module ``attention`` on the normalized rows ``h``, before
    out_proj, through the op (one opaque call for ``torch.compile`` and CUDA graphs)."""
    return torch.ops.kkdeploy_faithful.qkv_attention(
        h, attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight, attention.q_proj.bias,
        attention.k_proj.bias, attention.v_proj.bias, valid_token_mask, attention.num_heads, attention.causal)


# ----------------------------------------------------------------------------------------------
# the proof
# ----------------------------------------------------------------------------------------------


def qkv_attention_case(label: str, h: torch.Tensor, weights, biases, valid_token_mask, num_heads: int,
                       causal: bool) -> ProofCase:
    """One input set of the op (a block's normalized rows h [B, S, D], its q/k/v weights and biases, the mask): the
    reference composition against a launch."""
    return ProofCase(label, lambda: reference_qkv_attention(h, *weights, *biases, valid_token_mask, num_heads, causal),
                     lambda launch: run_launch(h, weights, biases, valid_token_mask, num_heads, causal, launch))


def prove_qkv_attention(device: torch.device | str, cases: list[ProofCase], shape: dict, *,
                        launches: Optional[list[str]] = None, budget_s: float = 20.0, repeats: int = 5,
                        cache: Optional[ProofCache] = None) -> ProofRecord:
    """Prove the launch's forms on ``cases`` (``qkv_attention_case``) at ``shape`` (``proof_shape``); remember the
    record for this process and in the on-disk cache. Where the launch cannot run at all, the record says why."""
    environment = proof_environment(device)
    refusal = kernel_refusal(shape["seq_len"], shape["d_model"], shape["heads"], torch.float16, device)
    if refusal:
        return ProofRecord(op=OP, shape=shape, environment=environment, reason=refusal)  # not cached: cheap
    if launches is None:
        from .fused_linear import multiprocessors

        sms = multiprocessors(device)
        launches = [n for n in BUILD_LAUNCHES if launch_pays(n, shape, sms)]
    record = prove_launches(OP, shape, [n for n in launches if n in LAUNCHES], cases, device,
                            environment=environment, budget_s=budget_s, repeats=repeats, against_reference=True)
    remember_proof(record, cache)
    return record
