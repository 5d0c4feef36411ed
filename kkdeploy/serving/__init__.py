"""Serving built artifacts on NVIDIA Triton Inference Server (design §9).

``triton_repo`` writes a model repository for what a build shipped; ``triton_server`` finds (or installs) a
``tritonserver`` binary and runs it on a repository with a clean lifecycle; ``triton_model`` is the
Python-backend model copied into repositories as ``model.py``. Nothing here is imported by the build or by
``kkdeploy.load``: serving is an optional layer on top of the artifacts, and its optional libraries
(``tritonclient``, the server itself) are imported lazily with an install hint.
"""

from .triton_repo import write_repository
from .triton_server import TritonServer, find_server, install_server, locate_server

__all__ = ["TritonServer", "find_server", "install_server", "locate_server", "write_repository"]
