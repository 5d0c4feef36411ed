"""scripts/wall_phases.py: the wall time of a command, to its first line, to a marked line, and to its exit."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "wall_phases.py"


def test_it_passes_the_output_through_and_times_the_phases_and_the_exit_code():
    child = ("import sys, time; print('header', flush=True); time.sleep(0.3); print('build 1.0 s: x', flush=True); "
             "time.sleep(0.3); print('oops', file=sys.stderr); sys.exit(3)")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mark", "^build [0-9]", "--", sys.executable, "-c", child],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["header", "build 1.0 s: x", "oops"]
    m = re.fullmatch(r"WALL first-line ([0-9.]+) s, mark ([0-9.]+) s, exit ([0-9.]+) s, rc 3", lines[-1])
    assert m, lines[-1]
    first, mark, end = map(float, m.groups())
    assert first <= mark <= end and mark - first >= 0.25 and end - mark >= 0.25


def test_an_unmatched_mark_is_a_dash():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--", sys.executable, "-c", "print('hi')"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and ", mark - s," in proc.stdout.splitlines()[-1]
