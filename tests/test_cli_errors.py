"""A dependency missing from the environment is a one-line error naming the package, not a traceback.

Seen on the H200: `kkdeploy run` in a shell without the carried polygraphy on PYTHONPATH died in a stack
trace from an import inside the command table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _without_polygraphy(*argv: str) -> tuple[int, list[str]]:
    code = ("import sys; sys.modules['polygraphy'] = None\n"  # as if polygraphy were not installed
            "from kkdeploy.cli import main\n"
            f"sys.exit(main({list(argv)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc.returncode, [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]


def test_missing_dependency_is_one_line_and_exit_2(tmp_path):
    # a build and a bench validate with Polygraphy: they stop before any work, in one line naming the package
    for command in (["build", "--shape", "3", "--out", str(tmp_path / "b")], ["bench", "--shape", "3"]):
        code, lines = _without_polygraphy(*command)
        assert code == 2 and len(lines) == 1, lines
        assert "'polygraphy'" in lines[0] and "pip install polygraphy" in lines[0]
    assert not (tmp_path / "b").exists()
    # the rest of the command table does not need it: `run` gets as far as its own one-line answer
    code, lines = _without_polygraphy("run", "--artifacts", "nowhere")
    assert code == 2 and len(lines) == 1 and "nowhere is not a directory" in lines[0]


def test_the_command_exits_quickly_yet_runs_what_the_interpreters_exit_would():
    # cli.entry ends the process without the interpreter's teardown; thread pools, atexit handlers, finalizers of
    # temporary directories and buffered output must still be done, and the exit code kept.
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as parent:
        code = (
            "import atexit, concurrent.futures, sys, tempfile, time\n"
            "from kkdeploy import cli\n"
            "def fake_main(argv=None):\n"
            "    pool = concurrent.futures.ThreadPoolExecutor(1)\n"
            "    pool.submit(lambda: (time.sleep(0.3), print('pool work done', flush=True)))\n"
            "    atexit.register(lambda: print('atexit ran'))\n"
            f"    fake_main.tmp = tempfile.TemporaryDirectory(dir={parent!r})\n"
            "    sys.stdout.write('buffered, no newline')\n"
            "    return 3\n"
            "cli.main = fake_main\n"
            "cli.entry()\n"
            "print('not reached')\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        import os

        left = os.listdir(parent)
    assert proc.returncode == 3, proc.stderr
    assert "buffered, no newline" in proc.stdout and "pool work done" in proc.stdout and "atexit ran" in proc.stdout
    assert "not reached" not in proc.stdout
    assert left == []  # the temporary directory's finalizer ran


def test_python_dash_m_kkdeploy_keeps_the_exit_code_of_an_error():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kkdeploy", "build", "--shape", "99"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_options_are_written_in_full_and_a_mistake_is_one_line(capsys):
    """Seen on the GPU: `kkdeploy loadtest ... --out DIR` was taken as an abbreviation of `--output-device` and
    refused with a usage block about that option's choices (loadtest has its own `--out` now). Options are not
    abbreviated; a mistake is one line that names the subcommand, the argument, and where the options are listed."""
    import pytest

    from kkdeploy.cli import main

    cases = [(["loadtest", "--artifacts", "a", "--output", "d"], "kkdeploy loadtest: error: unrecognized "
                                                                 "arguments: --output d (options are written in full"),
             (["build", "--shap", "3"], "kkdeploy build: error: unrecognized arguments: --shap 3"),
             (["build", "--shape", "3", "--out", "o", "--weight", "w"], "unrecognized arguments: --weight w"),
             (["loadtest"], "kkdeploy loadtest: error: the following arguments are required: --artifacts")]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2
        assert err.count("\n") == 1 and expected in err and "--help` lists what it takes" in err, err
