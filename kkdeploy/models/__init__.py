"""The model family, on the ground floor: everything else imports these, they import nothing above them.

``ReferenceTransformer`` is design.md §2 operation for operation (the contract every engine is held
to); the others are faster forms with the same parameter names, each validated against it:
``OptimizedTransformer`` (packed QKV + SDPA in the last layers, the PyTorch fallback),
``FusedTransformer`` (SDPA everywhere, judge contract), ``MixedPrecisionTransformer`` (float16
blocks in a float32 model), ``LongContextTransformer`` (shape 14, bounded memory) and the
independent ``TiledReferenceTransformer`` it is checked against. ``weights`` seeds, loads and
hashes their parameters.
"""

from .fused import FusedTransformer
from .long_context import LongContextTransformer
from .mixed import MixedPrecisionTransformer
from .optimized import OptimizedTransformer
from .reference import ReferenceTransformer
from .tiled_reference import TiledReferenceTransformer

__all__ = [
    "FusedTransformer",
    "LongContextTransformer",
    "MixedPrecisionTransformer",
    "OptimizedTransformer",
    "ReferenceTransformer",
    "TiledReferenceTransformer",
]
