#!/usr/bin/env python3
"""Where a command's wall time goes: to its first line of output, to a line matching a pattern, and to its exit.

    python3 scripts/wall_phases.py --mark '^build [0-9]' -- python3 -m kkdeploy build --shape 6 --device cuda ...

Why: a build's own clock (``build_seconds``, the "build N s" line) starts after the interpreter has imported torch
and stops before the process has torn down its compile workers; a user timing ``kkdeploy build`` sees both. The
command's output passes through unchanged (stdout and stderr merged); the last line printed is
``WALL first-line A s, mark B s, exit C s, rc R``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mark", default=r"^build [0-9]", help="regex of the line whose arrival is timed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    pattern = re.compile(args.mark)
    start = time.perf_counter()
    first = mark = None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        now = time.perf_counter() - start
        first = now if first is None else first
        if mark is None and pattern.search(line):
            mark = now
        sys.stdout.write(line)
    rc = proc.wait()
    end = time.perf_counter() - start

    def fmt(t):
        return "-" if t is None else f"{t:.1f}"

    print(f"WALL first-line {fmt(first)} s, mark {fmt(mark)} s, exit {end:.1f} s, rc {rc}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
