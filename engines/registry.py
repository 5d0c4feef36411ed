"""One descriptor per backend, registered by the module that implements it; every table of backends derives from it.

A backend module ends with ``register(BackendDescriptor(...))``, so adding a backend is one module, and nothing
else spells out its names. What kkdeploy asks of a backend before it builds anything is read from its descriptor:

* ``choices``: the names ``kkdeploy build --backends`` accepts for it, which of its variants each builds, and on
  which devices a build without ``--backends`` asks for it (``BackendChoice``);
* ``recipe_name``: its name at the start of every candidate name (``engines.recipe``'s grammar), and the
  attention forms and precision plans it can build (``attentions``, ``precisions``);
* ``needs_onnx``: whether it builds from the exported ONNX graph (the build exports only when one does);
* ``libraries``: the library versions its engines depend on; a different version may round differently, so
  ``kkdeploy.load`` serves the fallback on a mismatch;
* ``default_variants``: what it builds when a choice names no variants.

The tables the rest of the code once kept by hand (``engines.BACKEND_MODULES``, ``engines.recipe.BACKENDS``,
``kkdeploy.pipeline.build.BACKEND_CHOICES`` and ``RECIPE_BACKEND_KEYS``, ``kkdeploy.pipeline.runtime.BACKEND_LIBRARIES``)
are derived from the registry each time they are read, so a backend registered later (a test's) appears in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kkdeploy.errors import KKError

DefaultVariants = Callable[[torch.device, torch.dtype, str], list[str]]  # (device, dtype, contract) -> names


@dataclass(frozen=True)
class BackendChoice:
    """One ``--backends`` name of a backend."""

    name: str  # what the user types: "ort-cuda", "torch-compile-fused"
    variants: tuple[str, ...] | None = None  # the candidates it restricts its backend to; None: the defaults
    default_on: tuple[str, ...] = ()  # device types on which a build without --backends asks for it


@dataclass(frozen=True)
class BackendDescriptor:
    """What kkdeploy knows of one backend without importing its optional libraries."""

    key: str  # the backend's ``Backend.name``, recorded as each candidate's ``backend`` in manifests
    module: str  # "module" (its ``BACKEND``) or "module:ATTRIBUTE": how any process, a fresh one too, loads it
    choices: tuple[BackendChoice, ...]
    recipe_name: str | None = None  # the candidate names' backend ("torch-compile"); None: outside the grammar
    libraries: tuple[str, ...] = ()  # library versions its engines depend on (artifacts.library_versions keys)
    needs_onnx: bool = False
    default_variants: DefaultVariants | None = None  # None: the backend's one candidate, named as its recipe
    attentions: frozenset[str] = frozenset({"reference"})  # engines.recipe attention forms it can build
    precisions: frozenset[str] = frozenset({"model"})  # engines.recipe precision plans it can build

    def variants(self, device: torch.device, dtype: torch.dtype, contract: str = "strict") -> list[str]:
        """The candidates a choice without ``variants`` builds for this device, dtype and contract."""
        if self.default_variants is None:
            return [self.recipe_name or self.key]
        return list(self.default_variants(torch.device(device), dtype, contract))


DESCRIPTORS: dict[str, BackendDescriptor] = {}  # backend key -> descriptor, in registration order


def register(descriptor: BackendDescriptor) -> BackendDescriptor:
    """Add ``descriptor`` (a module registering itself again, on reload, replaces its own entry). A ``--backends``
    name or a recipe name already taken by another backend is a programming error, refused here."""
    for other in DESCRIPTORS.values():
        if other.key == descriptor.key:
            continue
        taken = {c.name for c in other.choices} & {c.name for c in descriptor.choices}
        if taken or (descriptor.recipe_name is not None and other.recipe_name == descriptor.recipe_name):
            raise ValueError(f"backend {descriptor.key!r} takes {sorted(taken) or descriptor.recipe_name!r}, "
                             f"already {other.key!r}'s")
    DESCRIPTORS[descriptor.key] = descriptor
    return descriptor


def descriptor(key: str) -> BackendDescriptor:
    """The descriptor of a backend key, or a one-line KKError naming the registered ones."""
    try:
        return DESCRIPTORS[key]
    except KeyError:
        raise KKError(f"unknown backend {key!r}; registered: {', '.join(DESCRIPTORS)}") from None


def choice(name: str) -> tuple[BackendDescriptor, BackendChoice] | None:
    """The backend and choice a ``--backends`` name stands for; None if no backend offers it."""
    for desc in DESCRIPTORS.values():
        for option in desc.choices:
            if option.name == name:
                return desc, option
    return None


def choice_names() -> list[str]:
    return [option.name for desc in DESCRIPTORS.values() for option in desc.choices]


def default_choices(device_type: str) -> list[str]:
    """What a build without ``--backends`` asks for on this device type, in registration order."""
    return [option.name for desc in DESCRIPTORS.values() for option in desc.choices if device_type in option.default_on]


def recipe_backends() -> dict[str, BackendDescriptor]:
    """``engines.recipe``'s backend names -> descriptors (backends outside the grammar left out)."""
    return {desc.recipe_name: desc for desc in DESCRIPTORS.values() if desc.recipe_name is not None}


def libraries(key: str) -> tuple[str, ...]:
    """The library versions a backend's engines depend on; none for a backend not registered here."""
    desc = DESCRIPTORS.get(key)
    return desc.libraries if desc is not None else ()


# -- the tables, derived ------------------------------------------------------------------------------
def backend_modules() -> dict[str, str]:
    """backend key -> importable spec (``engines.BACKEND_MODULES``)."""
    return {desc.key: desc.module for desc in DESCRIPTORS.values()}


def backend_choices() -> dict[str, tuple[str, list[str] | None]]:
    """--backends name -> (backend key, candidate filter) (``kkdeploy.pipeline.build.BACKEND_CHOICES``)."""
    return {option.name: (desc.key, None if option.variants is None else list(option.variants))
            for desc in DESCRIPTORS.values() for option in desc.choices}


def recipe_backend_keys() -> dict[str, str]:
    """recipe backend name -> backend key (``kkdeploy.pipeline.build.RECIPE_BACKEND_KEYS``)."""
    return {name: desc.key for name, desc in recipe_backends().items()}


def backend_libraries() -> dict[str, tuple[str, ...]]:
    """backend key -> libraries (``kkdeploy.pipeline.runtime.BACKEND_LIBRARIES``)."""
    return {desc.key: desc.libraries for desc in DESCRIPTORS.values()}


def onnx_backends() -> set[str]:
    """Backend keys that build from the exported ONNX graph (``kkdeploy.pipeline.build.ONNX_BACKENDS``)."""
    return {desc.key for desc in DESCRIPTORS.values() if desc.needs_onnx}
