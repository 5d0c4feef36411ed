"""A dependency missing from the environment is a one-line error naming the package, not a traceback.

Seen on the H200: `kkdeploy run` in a shell without the carried polygraphy on PYTHONPATH died in a stack
trace from an import inside the command table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_missing_dependency_is_one_line_and_exit_2():
    code = ("import sys; sys.modules['polygraphy'] = None\n"  # as if polygraphy were not installed
            "from kkdeploy.cli import main\n"
            "sys.exit(main(['run', '--artifacts', 'nowhere']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "'polygraphy'" in lines[0] and "pip install polygraphy" in lines[0]
