import importlib.util
from pathlib import Path

import pytest
import torch

from kkdeploy import TransformerConfig
from kkdeploy.models.weights import build_models

torch.set_num_threads(2)

SMALL = TransformerConfig(batch_size=3, seq_len=16, d_model=32, num_heads=4, ffn_dim=48, num_layers=2, causal=True)
SMALL_NONCAUSAL = TransformerConfig(3, 16, 32, 4, 48, 2, causal=False)


@pytest.fixture
def small_config():
    return SMALL


def models_for(config, dtype=torch.float32, sdpa_layers=1, seed=0):
    return build_models(config, dtype, "cpu", seed=seed, sdpa_layers=sdpa_layers)


def load_script(name: str):
    """A module from scripts/ (run by hand, not a package), for tests of its functions and main()."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
