"""Children that may die: how a signal is named, and how a child and everything it started is ended.

Shared by the fresh-process load check (``engines.fresh_process``) and the proof step's child
(``kkdeploy.kernels.proof_process``): both run native code that can kill the process running it.

A child never outlives its parent. The parent ends it on every way out of the wait (``owned_child``: an interrupt, a
timeout of its own caller, an error), and the child ends itself when the parent dies without a word
(``die_with_parent``: SIGKILL, or SIGTERM's default). An orphaned proof child was seen on an H100 (session 39): a
study cut by its campaign step's time limit left its child proving on the GPU for minutes, under the next commands'
timings.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

#: the spawning process's pid, in a spawned child's environment (``die_with_parent``)
PARENT_ENV = "KKDEPLOY_PARENT_PID"
#: Linux's prctl option: a signal the kernel sends this process when the thread that spawned it ends
_PR_SET_PDEATHSIG = 1
#: a child's exit code when it found its parent gone before it could ask to die with it
ORPHANED_EXIT = 117


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
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), PARENT_ENV: str(os.getpid())})


@contextmanager
def owned_child(module: str, argv: list[str], log) -> Iterator[subprocess.Popen]:
    """``spawn_python``'s child, ended with everything it started (``kill_group``) if it still runs when the block
    is left: a KeyboardInterrupt (a campaign's time limit sends SIGINT), or an error in the parent's wait. A child in
    a session of its own gets no Ctrl-C from the terminal, so without this it would go on running on the GPU."""
    child = spawn_python(module, argv, log)
    try:
        yield child
    finally:
        if child.poll() is None:
            kill_group(child)


@functools.lru_cache(maxsize=None)
def _prctl() -> Optional[Callable]:
    """libc's ``prctl``, or None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def death_signal_hook(sig: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` for a child that is not one of our Python children (the Triton server): it receives ``sig``
    when its parent dies. ``prctl`` is looked up here, in the parent: the hook runs between fork and exec and must
    not load anything. None where there is no ``prctl``."""
    prctl = _prctl()
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))

    return hook


def die_with_parent() -> None:
    """In a child of ``spawn_python``, first thing: let the kernel kill this process when its parent ends
    (``PR_SET_PDEATHSIG``, Linux), so that a parent killed outright (SIGKILL, or SIGTERM's default, which runs no
    ``finally``) leaves no child behind. If the parent is already gone, exit now. Elsewhere (no prctl), nothing."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    prctl = _prctl()
    # not Linux, or refused: the parent's owned_child still ends it on every way out
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os._exit(ORPHANED_EXIT)


def adopt_sys_path(entries: list[str]) -> None:
    """In a child: its parent's ``sys.path`` entries ahead of its own (what ``spawn_python`` sent in a request)."""
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
