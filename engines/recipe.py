"""A candidate is a backend plus a recipe; its name is derived from them, in one place.

Names such as ``torch-compile-fused-half-gemm-mixed`` or ``ort-cuda-graph-autocast`` used to be
parsed by a regex in every engine. Here they are one small grammar over one small value:

    name = backend ["-" provider] ["-graph"] [attention suffix] [precision suffix] ["-split"] ["-pdl"]

    backend     ort (provider cpu|cuda) | trt | torch-graph | torch-compile | inductor | layer-graph
    capture     "-graph": ONNX Runtime replays a CUDA graph (torch-graph and torch-compile always
                capture on CUDA; that is part of the backend, not of the name)
    attention   "" reference order, every rounding point of design.md §2
                "-nomask" reference order without the mask ops (all-valid calls only)
                "-sdpa<k>" packed QKV + SDPA in the last k blocks (all-valid calls only)
                "-fused" Inductor's own fusion (torch-compile: SDPA in every block too, judge contract)
                "-faithful-attention" our bitwise fused attention kernel (kkdeploy.kernels); its attention form
                was spelled "faithful-kernel" in manifests written before it was renamed, one letter from the next
                "-faithful-kernels" that kernel plus our bitwise rows LayerNorm kernel (kkdeploy.kernels.layer_norm)
                "-faithful-gemms" both plus our GEMMs with fused epilogues (kkdeploy.kernels.fused_linear)
    precision   "" the model's dtype; "-mixed" calibrated float16 blocks; "-autocast" ModelOpt AutoCast;
                "-half-gemm" float16 GEMM inputs with float32 accumulation; "-half-gemm-mixed" both
    launch      "-pdl" (torch-compile's faithful graphs): kernels go out as programmatic dependent launches, each
                starting while the one before drains (kkdeploy/kernels/dependent_launch.py); the same arithmetic
                "-split" (layer-graph): a launch per block and per block's attention, not one persistent launch
                for the whole model (kkdeploy/kernels/layer_kernels.py)

``parse(name)`` and ``Recipe.name`` are inverse to each other for every name a backend accepts, so
artifacts written under the old names load unchanged, and the manifest and summary table show the
recipe's fields rather than asking a reader to decode the name.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass

from kkdeploy.errors import KKError

ATTENTION_SUFFIX = {"reference": "", "reference-nomask": "-nomask", "sdpa-last": "-sdpa", "fused": "-fused",
                    "faithful-attention": "-faithful-attention", "faithful-kernels": "-faithful-kernels",
                    "faithful-gemms": "-faithful-gemms"}
# Old spellings of attention forms, as manifests written before a rename record them -> today's name.
ATTENTION_ALIASES = {"faithful-kernel": "faithful-attention"}
PDL_SUFFIX = "-pdl"
SPLIT_SUFFIX = "-split"
#: the one backend whose launches can be split
SPLIT_BACKEND = "layer-graph"
PRECISION_SUFFIX = {"model": "", "fp16-blocks": "-mixed", "autocast": "-autocast", "half-gemm": "-half-gemm",
                    "half-gemm+fp16-blocks": "-half-gemm-mixed"}


def __getattr__(name: str):
    """``BACKENDS`` (the backend names of the grammar) and ``ALLOWED`` (backend -> (attention forms, precision
    plans) it can build), derived from the backends' descriptors (``engines.registry``) when read."""
    if name == "BACKENDS":
        return tuple(_backends())
    if name == "ALLOWED":
        return {name: (set(d.attentions), set(d.precisions)) for name, d in _backends().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backends() -> dict:
    from .registry import recipe_backends

    return recipe_backends()


@functools.lru_cache(maxsize=8)
def _name_pattern(backends: tuple[str, ...]) -> re.Pattern:
    return re.compile(
        rf"^(?P<backend>{'|'.join(map(re.escape, backends))})(?:-(?P<provider>cpu|cuda))?(?P<graph>-graph)?"
        r"(?P<attention>-nomask|-sdpa(?P<k>\d+)|-fused|-faithful-attention|-faithful-kernels|-faithful-gemms)?"
        r"(?P<precision>-half-gemm-mixed|-half-gemm|-mixed|-autocast)?(?P<split>-split)?(?P<pdl>-pdl)?$")


@dataclass(frozen=True)
class Recipe:
    backend: str
    provider: str = ""  # ONNX Runtime's execution provider (cpu, cuda); empty elsewhere
    graph_capture: bool = False  # ONNX Runtime CUDA-graph replay
    attention: str = "reference"
    sdpa_layers: int = 0  # with attention "sdpa-last": how many final blocks
    precision: str = "model"
    dependent_launch: bool = False  # "-pdl": programmatic dependent launches (torch-compile's faithful graphs)
    split_launches: bool = False  # "-split": layer-graph's launch per block instead of one for the model

    def __post_init__(self) -> None:  # a recipe read back from an old manifest speaks today's names
        object.__setattr__(self, "attention", ATTENTION_ALIASES.get(self.attention, self.attention))

    @property
    def name(self) -> str:
        parts = [self.backend]
        if self.provider:
            parts.append(f"-{self.provider}")
        if self.graph_capture:
            parts.append("-graph")
        parts.append(ATTENTION_SUFFIX[self.attention] + (str(self.sdpa_layers) if self.attention == "sdpa-last" else ""))
        parts.append(PRECISION_SUFFIX[self.precision])
        if self.split_launches:
            parts.append(SPLIT_SUFFIX)
        if self.dependent_launch:
            parts.append(PDL_SUFFIX)
        return "".join(parts)

    @property
    def all_valid_only(self) -> bool:
        """Serves all-valid calls only (its graph has no mask path)."""
        return self.attention in ("reference-nomask", "sdpa-last")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """The fields a summary table shows: 'sdpa-last 1, float16 blocks', 'reference'."""
        attention = f"sdpa-last {self.sdpa_layers}" if self.attention == "sdpa-last" else self.attention
        bits = [attention] + ([self.precision] if self.precision != "model" else [])
        if self.graph_capture:
            bits.append("cuda graph")
        if self.dependent_launch:
            bits.append("dependent launches")
        if self.backend == SPLIT_BACKEND:
            bits.append("a launch per block" if self.split_launches else "one persistent launch")
        return ", ".join(bits)


def parse(name: str) -> Recipe:
    """Candidate name -> Recipe, or a one-line KKError naming the grammar."""
    backends = _backends()
    match = _name_pattern(tuple(backends)).match(name)
    if match is None:
        raise KKError(f"unknown candidate {name!r}: names are <backend>[-cpu|-cuda][-graph][-nomask|-sdpa<k>|-fused|"
                      f"-faithful-attention|-faithful-kernels|-faithful-gemms][-half-gemm][-mixed|-autocast][-split]"
                      f"[-pdl] with backend one of {', '.join(backends)}")
    backend = match["backend"]
    attention = {None: "reference", "-nomask": "reference-nomask", "-fused": "fused",
                 "-faithful-attention": "faithful-attention", "-faithful-kernels": "faithful-kernels",
                 "-faithful-gemms": "faithful-gemms"}.get(
                     match["attention"], "sdpa-last")
    precision = {v: k for k, v in PRECISION_SUFFIX.items()}[match["precision"] or ""]
    recipe = Recipe(backend, match["provider"] or "", bool(match["graph"]), attention,
                    int(match["k"]) if match["k"] else 0, precision, bool(match["pdl"]), bool(match["split"]))
    attentions, precisions = backends[backend].attentions, backends[backend].precisions
    if (backend == "ort") != bool(recipe.provider) or (recipe.graph_capture and not (backend == "ort" and recipe.provider == "cuda")):
        raise KKError(f"unknown candidate {name!r}: only ONNX Runtime takes -cpu/-cuda, and only ort-cuda takes -graph")
    if attention not in attentions or precision not in precisions:
        raise KKError(f"unknown candidate {name!r}: {backend} builds attention {sorted(attentions)} with precision "
                      f"{sorted(precisions)}")
    if attention == "sdpa-last" and recipe.sdpa_layers < 1:
        raise KKError(f"unknown candidate {name!r}: -sdpa<k> needs k >= 1")
    if recipe.dependent_launch and (backend != "torch-compile" or attention == "fused"):
        raise KKError(f"unknown candidate {name!r}: -pdl applies to torch-compile's faithful graphs (not -fused)")
    if recipe.split_launches and backend != SPLIT_BACKEND:
        raise KKError(f"unknown candidate {name!r}: -split applies to {SPLIT_BACKEND} only")
    if backend == "torch-compile" and precision != "model" and attention != "fused":
        raise KKError(f"unknown candidate {name!r}: torch-compile's float16 blocks and half GEMMs come with -fused")
    return recipe


def recipe_record(name: str) -> dict:
    """The recipe's fields for a manifest entry; names outside the grammar (pytorch-fallback) get none."""
    try:
        return parse(name).to_dict()
    except KKError:
        return {}
