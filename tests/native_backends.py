"""Backends whose loaders run "native code" that misbehaves, for the fresh-process tests (issue 17).

They are real ``engines.base.Backend``s: the build and ``kkdeploy.load`` treat them like AOTInductor or
TensorRT (``loads_native_code``), but their loader kills its own process with SIGSEGV, hangs, or (``Faithful``)
serves the reference model from the artifact's weights -- unless ``KKDEPLOY_TEST_CRASH_ON_LOAD=1`` is set in
the loading process's environment, the stand-in for "this torch build segfaults on load".
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from engines.base import BUILT, Backend, CandidateResult, Runner

CRASH_ENV = "KKDEPLOY_TEST_CRASH_ON_LOAD"


class _NativeBackend(Backend):
    def loads_native_code(self, entry: dict) -> bool:
        return True

    def build(self, ctx, candidate: str) -> CandidateResult:
        return CandidateResult(candidate, self.key, BUILT, files=[])


class Segfaults(_NativeBackend):
    name = key = "segfault-on-load"

    def load(self, artifact_dir, entry, config, dtype, device) -> Runner:
        os.kill(os.getpid(), signal.SIGSEGV)


class SegfaultsAllValidOnly(Segfaults):
    """An all-valid-only engine (like inductor-sdpa1) whose loader segfaults: it must not reach validation."""

    name = key = "segfault-all-valid-only"

    def build(self, ctx, candidate: str) -> CandidateResult:
        return CandidateResult(candidate, self.key, BUILT, files=[], options={"all_valid_only": True})


class Hangs(_NativeBackend):
    name = key = "hang-on-load"

    def load(self, artifact_dir, entry, config, dtype, device) -> Runner:
        time.sleep(3600)


class ReferenceRunner(Runner):
    backend = "faithful-native"

    def __init__(self, model, config, dtype, device):
        super().__init__(config, dtype, device)
        self.model = model

    def infer(self, x, mask):
        return self.model(x, mask)


class Faithful(_NativeBackend):
    name = key = "faithful-native"

    def load(self, artifact_dir, entry, config, dtype, device) -> Runner:
        if os.environ.get(CRASH_ENV) == "1":
            os.kill(os.getpid(), signal.SIGSEGV)
        from safetensors.torch import load_file

        from kkdeploy.models import ReferenceTransformer

        model = ReferenceTransformer(config)
        model.load_state_dict(load_file(str(Path(artifact_dir) / "weights.safetensors")))
        return ReferenceRunner(model.to(device=device, dtype=dtype).eval(), config, dtype, device)


SEGFAULT, SEGFAULT_ALL_VALID_ONLY, HANG, FAITHFUL = Segfaults(), SegfaultsAllValidOnly(), Hangs(), Faithful()
