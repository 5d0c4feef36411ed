"""kkdeploy: export, build, validate and ship verified engines for the KernelKraft Transformer."""

from .config import OFFICIAL_SHAPES, TransformerConfig, official_config
from .errors import KKError
from .inputs import generate_case
from .models import OptimizedTransformer, ReferenceTransformer

__version__ = "0.1.0"

__all__ = [
    "OFFICIAL_SHAPES",
    "KKError",
    "OptimizedTransformer",
    "ReferenceTransformer",
    "TransformerConfig",
    "generate_case",
    "official_config",
]


def load(path, device=None):
    """Load verified artifacts and return a runner ``runner(x, valid_token_mask=None)``."""
    from .pipeline.runtime import load as _load

    return _load(path, device=device)
