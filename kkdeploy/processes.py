"""Children that may die: how a signal is named, and how a child and everything it started is ended.

Shared by the fresh-process load check (``engines.fresh_process``) and the proof step's child
(``kkdeploy.kernels.proof_process``): both run native code that can kill the process running it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


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


def spawn_python(module: str, argv: list[str], log) -> subprocess.Popen:
    """``python -m module argv...`` in a session of its own (``kill_group`` ends it and what it started), with this
    process's ``sys.path`` (a backend or task defined in a test is found by its module name), its output into
    ``log``. Spawned, never forked: a fork inherits the state that can hide a crash."""
    return subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def adopt_sys_path(entries: list[str]) -> None:
    """In a child: its parent's ``sys.path`` entries ahead of its own (what ``spawn_python`` sent in a request)."""
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
