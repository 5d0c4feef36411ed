"""The long-context path of the PyTorch fallback: attention without a dense score tensor.

* all-valid masks, no autograd: ``F.scaled_dot_product_attention`` restricted to the fused
  backends that never build [S,S] (flash; on CUDA also memory-efficient) -- never MATH. A
  refusal is a one-line ``KKError``, not a silent dense fallback.
* padded masks or gradient-enabled calls: query-tiled attention with the reference's rounding
  points (model-dtype scores, FP32 softmax, cast back). Under autograd each tile is
  checkpointed, so backward recomputes one ``[b,H,tile,S]`` tile at a time instead of keeping
  every tile's probabilities alive.
* batch micro-batching: ``micro_batch`` sequences run through the whole model at a time, so
  activations are bounded by the micro-batch, not by B.

Parameter names are those of ``ReferenceTransformer``; state dicts load strictly both ways.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ..config import TransformerConfig
from ..errors import KKError, first_line
from .reference import ReferenceTransformer, zero_invalid_rows

DEFAULT_QUERY_TILE = 128
DEFAULT_ACTIVATION_BUDGET = 1 << 30  # bytes of per-micro-batch activations when micro_batch is automatic


def fused_backends(device: torch.device) -> list[SDPBackend]:
    """SDPA kernels that never materialize scores: the CPU build has flash only (efficient is CUDA-only)."""
    if torch.device(device).type == "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION]


def backend_names(backends) -> str:
    return "+".join(b.name.lower() for b in backends)


def fused_attention(q, k, v, scale: float, causal: bool, backends) -> torch.Tensor:
    """SDPA on [b,H,S,Dh] with only ``backends`` allowed; a refusal becomes a one-line KKError."""
    try:
        with sdpa_kernel(list(backends)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    except RuntimeError as exc:
        reason = first_line(exc)
        raise KKError(
            f"scaled_dot_product_attention refused the {backend_names(backends)} backend(s) for "
            f"{q.dtype} {list(q.shape)} on {q.device} ({reason}); the math backend is never used for long "
            f"contexts: use a dtype/device these kernels support (float16 on CUDA, float32/float16 on the CPU)"
        ) from None


SOFTMAX_PATHS = ("auto", "aten", "block-kernel", "scores-kernel")


def attend_tile(q_tile, k_head, v_head, scale: float, query_start: int, causal: bool,
                key_valid, query_valid, row_len: int | None = None, softmax: str = "aten",
                lengths: torch.Tensor | None = None, launch: str | None = None) -> torch.Tensor:
    """One query tile against its keys with the reference's rounding points.

    ``key_valid`` [b,K] masks padded keys; ``query_valid`` [b,T] is given only for tiles holding
    invalid queries, which keep their keys so no row is empty (no NaN, also in backward) -- their
    outputs are zeroed after out_proj as in the reference.

    ``softmax="block-kernel"`` (causal float16 inference tiles): the scale, roundings, mask, casts and softmax
    as one kernel in ATen's block-softmax order over a row of ``row_len`` keys
    (``kkdeploy.kernels.block_softmax.causal_block_softmax``, launched as ``launch``; the reference composition
    off the GPU, and for rows that take ATen's shared-memory softmax, whose order the kernel does not reproduce).
    Padded calls reach it with ``lengths`` [b], each sequence's valid-prefix length: the kernel then masks keys
    at or past it for every query, exactly as the reference masks invalid keys.
    """
    tile, keys = q_tile.shape[-2], k_head.shape[-2]
    if (softmax == "block-kernel" and causal and q_tile.dtype == torch.float16  # the float16 reference only
            and (lengths is not None or key_valid is None)  # padded calls: prefix masks only
            and not torch.is_grad_enabled()):  # the kernel has no backward: autograd calls keep ATen's ops
        from kkdeploy.kernels.block_softmax import DEFAULT_LAUNCH, causal_block_softmax, kernel_covers

        if kernel_covers(row_len or keys):
            raw = torch.matmul(q_tile, k_head.transpose(-2, -1))  # [b,H,T,K]: row r is query query_start + r % T
            probs = causal_block_softmax(raw.reshape(-1, keys), scale, row_len or keys, query_start, tile,
                                         lengths=lengths, rows_per_sequence=raw.shape[1] * tile,
                                         launch=launch or DEFAULT_LAUNCH)
            return torch.matmul(probs.view_as(raw), v_head)
    scores = torch.matmul(q_tile, k_head.transpose(-2, -1)) * scale
    if causal:
        query_index = torch.arange(query_start, query_start + tile, device=q_tile.device)
        future = torch.arange(keys, device=q_tile.device)[None, :] > query_index[:, None]
        scores.masked_fill_(future, float("-inf"))
    if key_valid is not None:
        padded = ~key_valid[:, None, None, :]  # [b,1,1,K]
        if query_valid is not None:
            padded = padded & query_valid[:, None, :, None]  # [b,1,T,K]
        scores.masked_fill_(padded, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_tile.dtype)
    return torch.matmul(probs, v_head)


KEY_EXTENTS = ("auto", "full", "visible", "aligned")
#: ATen's block softmax folds a row in passes of 1024 threads x 4 elements (kkdeploy.kernels.block_softmax)
ALIGNED_KEY_BLOCK = 4096
#: the shortest 4096-multiple row that takes ATen's regular block softmax (not the shared-memory one)
ALIGNED_MIN_KEYS = 12288


def key_end(t1: int, limit: int, causal: bool, key_extent: str, seq_len: int | None = None) -> int:
    """The keys a query tile ending at row t1 - 1 reads, in a micro-batch whose keys from ``limit`` on are padding
    for every sequence, of rows ``seq_len`` long (default ``limit``: no padding).

    Every cut drops only keys that are -inf in every row of the tile (past its last query, or padding), and the
    rule for where a cut may fall is the same with or without padding:
    "full": every key, like the reference (the same reduction lengths, so the same rounding). "visible": a
    causal tile stops at its last query or the padding (half the work; it regroups the softmax, measured not
    bitwise). "aligned": the tile stops at the next multiple of 4096 keys past its last visible key, where ATen's
    block softmax gives every thread the same elements minus trailing -inf ones (bitwise for the softmax; the
    GEMMs' cuts measured bitwise on the H200 by scripts/shape14_tile_study.py), or reads the whole row when that
    is shorter. The cut is never below ``ALIGNED_MIN_KEYS``: shorter rows take ATen's shared-memory softmax,
    whose order differs (measured: a first tile cut at 4096 keys moved 18 probabilities of 1M). A cut at the
    padding itself (any position) would regroup the reductions: measured on the H200, 1-2,056 elements failed
    strict per padded trial before this rule."""
    seq_len = limit if seq_len is None else seq_len
    if key_extent == "full":
        return seq_len
    end = min(t1, limit) if causal else limit  # keys from here on are -inf in every row of the tile
    if key_extent == "visible":
        return end
    return min(seq_len, max(ALIGNED_MIN_KEYS, -(-end // ALIGNED_KEY_BLOCK) * ALIGNED_KEY_BLOCK))


class TileStep(NamedTuple):
    """One query tile of ``tiled_attention``: rows [t0, t1) against keys [0, k_end), and how it runs."""
    t0: int
    t1: int
    k_end: int
    softmax: str  # "block-kernel" or "aten" (what attend_tile will run for this tile)

    def feature(self, seq_len: int, padded: bool) -> str:
        """The code path this tile exercises, as validation counts it (``path_features``)."""
        rows = "full-rows" if self.k_end == seq_len else "cut-rows"
        return f"{'padded' if padded else 'all-valid'}/tiled/{rows}/{self.softmax}"


def tile_schedule(seq_len: int, limit: int, query_tile: int, causal: bool, key_extent: str, softmax: str,
                  padded: bool, prefix_mask: bool = True, dtype: torch.dtype = torch.float16,
                  inference: bool = True) -> list[TileStep]:
    """The tiles ``tiled_attention`` runs for rows of ``seq_len`` whose keys from ``limit`` on are padding for
    every sequence, each with its key cut and its softmax. Pure: the validation plan reads the same schedule the
    model runs (``path_features``). Tiles keep the all-valid boundaries (t1 = t0 + query_tile, not cut at the
    padding), so a padded call runs the same GEMM shapes as an all-valid one."""
    from kkdeploy.kernels.block_softmax import kernel_covers

    kernel = (softmax == "block-kernel" and causal and (prefix_mask or not padded) and kernel_covers(seq_len)
              and dtype == torch.float16 and inference)  # attend_tile's own conditions
    return [TileStep(t0, min(seq_len, t0 + query_tile),
                     key_end(min(seq_len, t0 + query_tile), limit, causal, key_extent, seq_len),
                     "block-kernel" if kernel else "aten")
            for t0 in range(0, limit, query_tile)]


def prefix_lengths(valid_token_mask: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's valid length if every mask row is a valid prefix (the generator's masks are), else None."""
    lengths = valid_token_mask.sum(dim=1)
    positions = torch.arange(valid_token_mask.shape[1], device=valid_token_mask.device)
    return lengths if torch.equal(valid_token_mask, positions[None, :] < lengths[:, None]) else None


def tiled_attention(q, k, v, scale: float, causal: bool, valid_token_mask, query_tile: int,
                    key_extent: str = "full", softmax: str = "aten", launch: str | None = None,
                    trace: set | None = None) -> torch.Tensor:
    """Query-tiled attention on [b,H,S,Dh]: the largest temporary is [b,H,query_tile,S].

    Positions after the last valid token of the micro-batch are invalid for every sequence: query tiles wholly
    past it are skipped and left at 0 (they are zeroed after out_proj anyway); key cuts follow ``key_end``.
    ``trace``, when given, collects the code paths the tiles ran (``TileStep.feature``).
    """
    b, h, s, dh = q.shape
    key_extent, softmax = resolve_tiled_settings(key_extent, softmax, q.device, q.dtype, s, h * query_tile)
    if softmax == "block-kernel" and launch is None:
        launch = softmax_launch(q.device, q.dtype, s, h * query_tile)
    limit, all_valid_rows, lengths = s, None, None
    if valid_token_mask is not None and bool(valid_token_mask.all()):
        valid_token_mask = None  # masks nothing: the same bits, and the fused block softmax applies
    if valid_token_mask is not None:
        valid_positions = torch.nonzero(valid_token_mask.any(dim=0)).reshape(-1)
        limit = int(valid_positions.max()) + 1 if valid_positions.numel() else 0
        all_valid_rows = valid_token_mask.all(dim=0).cpu()  # one sync: which tiles hold invalid queries
        if softmax == "block-kernel":
            lengths = prefix_lengths(valid_token_mask)
    padded = valid_token_mask is not None
    schedule = tile_schedule(s, limit, query_tile, causal, key_extent, softmax, padded, lengths is not None, q.dtype,
                             not torch.is_grad_enabled())
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    pieces, context = [], None if grad else q.new_zeros(b, h, s, dh)
    for step in schedule:
        t0, t1, k_end = step.t0, step.t1, step.k_end
        key_valid = query_valid = None
        if valid_token_mask is not None:
            key_valid = valid_token_mask[:, :k_end]
            if not bool(all_valid_rows[t0:t1].all()):
                query_valid = valid_token_mask[:, t0:t1]
        args = (q[:, :, t0:t1], k[:, :, :k_end], v[:, :, :k_end], scale, t0, causal, key_valid, query_valid, s,
                step.softmax, lengths, launch)
        if trace is not None:
            trace.add(step.feature(s, padded))
        if grad:
            pieces.append(checkpoint(attend_tile, *args, use_reentrant=False))
        else:
            context[:, :, t0:t1] = attend_tile(*args)
    if not grad:
        return context
    covered = schedule[-1].t1 if schedule else 0
    if covered < s:
        pieces.append(q.new_zeros(b, h, s - covered, dh))
    return torch.cat(pieces, dim=2)


def activation_bytes_per_sequence(config: TransformerConfig, seq_len: int, dtype: torch.dtype) -> int:
    """Live activations of one sequence in one block: x, h, q, k, v, context, out, FFN hidden (~2x)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return seq_len * (8 * config.d_model + 2 * config.ffn_dim) * itemsize


def resolve_tiled_settings(key_extent: str, softmax: str, device, dtype: torch.dtype, seq_len: int | None = None,
                           rows: int | None = None) -> tuple[str, str]:
    """``"auto"`` -> what the tiled layers run here: aligned key cuts with the block-softmax kernel where a proof
    made in this environment found the kernel bit-identical for rows of ``seq_len`` keys, ``rows`` (heads x
    query tile) per launch (``kkdeploy.kernels.block_softmax.proven_launch``; the build proves it), else full
    key rows with ATen's ops (bitwise, slower). Explicit settings are kept."""
    if "auto" not in (key_extent, softmax):
        return key_extent, softmax
    from kkdeploy.kernels.block_softmax import fast_path_reason

    fast = seq_len is not None and fast_path_reason(device, dtype, seq_len, rows) is None
    return ((("aligned" if fast else "full") if key_extent == "auto" else key_extent),
            (("block-kernel" if fast else "aten") if softmax == "auto" else softmax))


def softmax_launch(device, dtype: torch.dtype, seq_len: int, rows: int) -> str | None:
    """The block-softmax launch proven here for this op shape (None: the kernel's default launch, for explicit
    ``softmax="block-kernel"`` calls, or ATen's ops under ``"auto"``)."""
    from kkdeploy.kernels.block_softmax import proven_launch

    return proven_launch(device, dtype, seq_len, rows)


def scores_kernel_launch(device, dtype: torch.dtype, seq_len: int, heads: int, head_dim: int) -> str | None:
    """The scores-attention launch proven here for this op shape (bit-identical, faster than the block-kernel path:
    ``kkdeploy.kernels.scores_attention``), else None."""
    from kkdeploy.kernels.scores_attention import proven_launch

    return proven_launch(device, dtype, seq_len, heads, head_dim)


class LongContextTransformer(ReferenceTransformer):
    """Bounded-memory forward of the reference model; same parameters, same call signature."""

    def __init__(self, config: TransformerConfig, micro_batch: int | None = None,
                 query_tile: int = DEFAULT_QUERY_TILE, activation_budget: int = DEFAULT_ACTIVATION_BUDGET,
                 backends: list[SDPBackend] | None = None, sdpa_layers: int | None = None,
                 key_extent: str = "auto", softmax: str = "auto"):
        super().__init__(config)
        if key_extent not in KEY_EXTENTS:
            raise KKError(f"key_extent must be one of {', '.join(KEY_EXTENTS)}, got {key_extent!r}")
        if softmax not in SOFTMAX_PATHS:
            raise KKError(f"softmax must be one of {', '.join(SOFTMAX_PATHS)}, got {softmax!r}")
        # "auto" (the default): resolved per call by resolve_tiled_settings (the proven fast path, else full rows)
        self.key_extent = key_extent
        self.softmax = softmax
        if sdpa_layers is None:
            sdpa_layers = config.num_layers
        if isinstance(sdpa_layers, bool) or not isinstance(sdpa_layers, int) or not 0 <= sdpa_layers <= config.num_layers:
            raise KKError(f"sdpa_layers must be between 0 and num_layers={config.num_layers}, got {sdpa_layers!r}")
        # Fused kernels round differently from the reference (online softmax, late normalization):
        # in FP16 that can break the strict rule, so only the last ``sdpa_layers`` layers use them and
        # earlier layers run the tiled reference-order attention (calibrated per shape by validation).
        self.sdpa_layers = sdpa_layers
        for name, value in (("micro_batch", micro_batch), ("query_tile", query_tile),
                            ("activation_budget", activation_budget)):
            if value is None and name == "micro_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KKError(f"{name} must be a positive integer, got {value!r}")
        self.micro_batch = micro_batch
        self.query_tile = query_tile
        self.activation_budget = activation_budget
        self.backends = backends  # None: chosen from the device at call time
        self.last_attention_path: str | None = None
        self.last_tiled_settings: tuple[str, str] | None = None  # (key_extent, softmax) the tiled layers ran
        self.last_softmax_launch: str | None = None  # the block-softmax launch the tiled layers ran, if any
        self.last_path_features: set[str] = set()  # the code paths the last call ran (``path_features``)

    def sequences_per_micro_batch(self, batch: int, seq_len: int) -> int:
        if self.micro_batch is not None:
            return min(self.micro_batch, batch)
        per_sequence = activation_bytes_per_sequence(self.config, seq_len, self.dtype)
        return max(1, min(batch, self.activation_budget // max(per_sequence, 1)))

    def tiled_settings(self, device, dtype, seq_len: int | None = None) -> tuple[str, str]:
        """(key_extent, softmax) of the tiled layers on ``device`` in ``dtype`` for rows of ``seq_len`` keys
        (``"auto"`` resolved: the proven fast path, else full rows)."""
        return resolve_tiled_settings(self.key_extent, self.softmax, device, dtype, seq_len,
                                      self.config.num_heads * self.query_tile)

    def scores_launch(self, device, dtype, seq_len: int, inference: bool = True) -> str | None:
        """The scores-attention launch the tiled layers run on whole sequences instead of query tiles, else None.
        ``"auto"``: where a proof made here found one bit-identical and faster (the build proves it);
        ``"scores-kernel"``: that launch, else the default launch wherever the kernels can run at all. Causal
        float16 inference calls only (the kernels have no backward)."""
        if self.softmax not in ("auto", "scores-kernel") or not self.config.causal or dtype != torch.float16:
            return None
        if not inference:
            return None
        launch = scores_kernel_launch(device, dtype, seq_len, self.config.num_heads, self.config.head_dim)
        if launch is None and self.softmax == "scores-kernel":
            from kkdeploy.kernels.scores_attention import DEFAULT_LAUNCH, kernel_refusal

            if kernel_refusal(device, dtype, seq_len, self.config.head_dim) is None:
                launch = DEFAULT_LAUNCH
        return launch

    def path_features(self, seq_len: int, padded: bool, device, dtype, inference: bool = True) -> set[str]:
        """The code paths a call on rows of ``seq_len`` may run (all-valid, or padded: every tile), named as
        ``last_path_features`` records them. Validation
        compares the features a full-size call would run with those its trials ran: a path no trial ran must not
        ship. SDPA's features carry the row length, since its online softmax rounds differently at every length;
        the tiled path's do not: it reproduces the reference's reductions whatever the length. ``inference``: an
        inference call (autograd calls run every layer tiled)."""
        features = set()
        fused_layers = 0 if padded or not inference else self.sdpa_layers
        if fused_layers:
            features.add(f"all-valid/sdpa@{seq_len}")
        if fused_layers < self.config.num_layers and self.scores_launch(device, dtype, seq_len, inference):
            features.add(f"{'padded' if padded else 'all-valid'}/scores-kernel")
        elif fused_layers < self.config.num_layers:
            key_extent, softmax = self.tiled_settings(device, dtype, seq_len)
            for step in tile_schedule(seq_len, seq_len, self.query_tile,
                                      self.config.causal, key_extent, softmax, padded, dtype=dtype,
                                      inference=inference):
                features.add(step.feature(seq_len, padded))
        return features

    def attention_path(self, valid_token_mask) -> str:
        """'sdpa-<backends>' for all-valid inference calls, else 'tiled'."""
        all_valid = valid_token_mask is None or bool(valid_token_mask.all())
        if all_valid and not torch.is_grad_enabled() and self.sdpa_layers:
            fused = "sdpa-" + backend_names(self.backends or fused_backends(self.device))
            if self.sdpa_layers < self.config.num_layers:
                fused += f" in the last {self.sdpa_layers} layer(s), tiled before"
            return fused
        return "tiled"

    def attention_block(self, layer, h, valid_token_mask, fused: bool) -> torch.Tensor:
        attn = layer.attention
        q = attn.split_heads(attn.q_proj(h))
        k = attn.split_heads(attn.k_proj(h))
        v = attn.split_heads(attn.v_proj(h))
        scores = None if fused else self.scores_context(q, k, v, attn.scale, valid_token_mask)
        if fused:
            context = fused_attention(q, k, v, attn.scale, attn.causal, self.backends or fused_backends(q.device))
            self.last_path_features.add(f"all-valid/sdpa@{q.shape[-2]}")
        elif scores is not None:
            context = scores
        else:
            key_extent, softmax = self.tiled_settings(q.device, q.dtype, q.shape[-2])
            launch = None
            if softmax == "block-kernel":
                launch = softmax_launch(q.device, q.dtype, q.shape[-2], q.shape[1] * self.query_tile)
                self.last_softmax_launch = launch
            context = tiled_attention(q, k, v, attn.scale, attn.causal, valid_token_mask, self.query_tile,
                                      key_extent, softmax, launch, self.last_path_features)
        del q, k, v
        b, s, d = h.shape
        return zero_invalid_rows(attn.out_proj(context.transpose(1, 2).reshape(b, s, d)), valid_token_mask)

    def scores_context(self, q, k, v, scale: float, valid_token_mask) -> torch.Tensor | None:
        """The whole micro-batch's attention through the scores-attention kernels where they run here (all-valid
        or prefix masks, inference), else None (the query tiles run)."""
        seq_len = q.shape[-2]
        launch = self.scores_launch(q.device, q.dtype, seq_len, not torch.is_grad_enabled())
        if launch is None:
            return None
        mask = valid_token_mask
        if mask is not None and bool(mask.all()):
            mask = None  # masks nothing: the same bits
        lengths = None if mask is None else prefix_lengths(mask)
        if mask is not None and lengths is None:
            return None  # not a prefix mask: the tiles handle any mask
        from kkdeploy.kernels.scores_attention import scores_attention

        queries = seq_len if lengths is None else int(lengths.max())  # rows past every length stay 0
        context = scores_attention(q, k, v, scale, lengths, launch, queries)
        self.last_softmax_launch = f"scores-attention {launch}"
        self.last_path_features.add(f"{'all-valid' if mask is None else 'padded'}/scores-kernel")
        return context

    def micro_batch_forward(self, x, valid_token_mask, fused: bool) -> torch.Tensor:
        mask = None if fused else valid_token_mask  # fused means all valid: zeroing is a no-op
        first_fused = len(self.layers) - self.sdpa_layers
        for index, layer in enumerate(self.layers):
            x = x + self.attention_block(layer, layer.norm1(x), mask, fused and index >= first_fused)
            x = x + layer.feed_forward(x)
            x = zero_invalid_rows(x, mask)
        return zero_invalid_rows(self.final_norm(x), mask)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.check_call(x, valid_token_mask)
        path = self.attention_path(valid_token_mask)
        self.last_attention_path = path
        self.last_tiled_settings = self.tiled_settings(x.device, x.dtype, x.shape[1]) if "tiled" in path else None
        self.last_softmax_launch = None
        self.last_path_features = set()
        fused = path != "tiled"
        batch, seq = x.shape[:2]
        step = self.sequences_per_micro_batch(batch, seq)
        grad = torch.is_grad_enabled()
        out = None if grad else torch.empty_like(x)
        pieces = []
        for start in range(0, batch, step):
            chunk = slice(start, start + step)
            mask = None if valid_token_mask is None else valid_token_mask[chunk]
            y = self.micro_batch_forward(x[chunk], mask, fused)
            if grad:
                pieces.append(y)
            else:
                out[chunk] = y
                del y
        return torch.cat(pieces, dim=0) if grad else out
