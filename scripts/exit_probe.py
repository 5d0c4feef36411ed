#!/usr/bin/env python3
"""Run ``kkdeploy`` ARGS and print when its ``main()`` returned and when the exit handlers were done.

    python3 scripts/wall_phases.py -- python3 scripts/exit_probe.py build --shape 6 --device cuda ...

Why: ``wall_phases.py`` sees the process exit; this splits what comes after the command's work into the exit
handlers (``atexit``: Inductor's compile workers, logging) and the interpreter's own teardown (the rest, up to the
exit that ``wall_phases.py`` times). Prints ``EXIT main-returned T threads [...]`` and ``EXIT atexit-done T``,
seconds since this script started.
"""

import atexit
import runpy
import sys
import threading
import time
from pathlib import Path

t0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, as the other scripts: no install needed
atexit.register(lambda: print(f"EXIT atexit-done {time.perf_counter() - t0:.2f}", flush=True))  # registered first: runs last
sys.argv = ["kkdeploy", *sys.argv[1:]]
from kkdeploy import cli  # noqa: E402

command = cli.main


def timed_main(argv=None):
    code = command(argv)
    names = [t.name for t in threading.enumerate()]
    print(f"EXIT main-returned {time.perf_counter() - t0:.2f} threads {names}", flush=True)
    return code


cli.main = timed_main  # ``cli.entry`` looks it up when it runs
runpy.run_module("kkdeploy", run_name="__main__")
