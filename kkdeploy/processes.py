"""Children that may die: how a signal is named, and how a child and everything it started is ended.

Shared by the fresh-process load check (``engines.fresh_process``) and the proof step's child
(``kkdeploy.kernels.proof_process``): both run native code that can kill the process running it.
"""

from __future__ import annotations

import os
import signal
import subprocess


def signal_reason(returncode: int) -> str:
    """``-11`` -> 'SIGSEGV (signal 11)'."""
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "signal"
    return f"{name} (signal {number})"


def kill_group(child: subprocess.Popen) -> None:
    """The child and everything it started: a hung loader may have spawned compiler workers."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        child.kill()
    child.wait()
