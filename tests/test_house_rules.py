"""House rules the code keeps: the floors import one way, and the CLI takes its choices and defaults from the
modules that own them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions too), as absolute names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this file's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "engines").glob("*.py")), ids=lambda p: p.name)
def test_engines_import_nothing_from_the_floors_above(path):
    """engines/ sits below validation/ and the pipeline: calibration reaches it as BuildContext.calibrate."""
    above = ("validation", "kkdeploy.pipeline", "kkdeploy.commands", "kkdeploy.serving", "kkdeploy.cli")
    bad = sorted(m for m in imported_modules(path) if any(m == a or m.startswith(a + ".") for a in above))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "validation").glob("*.py")), ids=lambda p: p.name)
def test_validation_imports_no_engine_and_no_pipeline(path):
    bad = sorted(m for m in imported_modules(path)
                 if m.split(".")[0] == "engines" or m.startswith(("kkdeploy.pipeline", "kkdeploy.commands")))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_ground_floor_imports_no_stage():
    for path in [*(ROOT / "kkdeploy").glob("*.py")]:
        if path.name in ("__init__.py", "__main__.py", "cli.py"):  # the package's entry points, above everything
            continue
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("engines", "validation", "exporters")
                     or m.startswith(("kkdeploy.pipeline", "kkdeploy.commands", "kkdeploy.serving")))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def subcommand(name: str):
    from kkdeploy.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    return {a.dest: a for a in subparsers.choices[name]._actions}


def test_the_cli_takes_choices_and_defaults_from_their_owners():
    from engines.ort import OPT_LEVELS
    from exporters.options import LAYER_NORM_MODES, LINEAR_MODES
    from kkdeploy.pipeline.bench import DEFAULT_PROCESSES, BenchOptions
    from kkdeploy.pipeline.build import BuildRequest
    from kkdeploy.pipeline.timing import DEFAULT_REPEATS, DEFAULT_ROUNDS, DEFAULT_WARMUPS
    from validation.strict import CONTRACTS, DEFAULT_CONTRACT
    from validation.trials import DEFAULT_PADDING_RATIO

    for name in ("build", "check", "bench", "run"):
        assert subcommand(name)["contract"].choices == list(CONTRACTS)
    build, bench = subcommand("build"), subcommand("bench")
    assert build["linear"].choices == list(LINEAR_MODES) and build["layer_norm"].choices == list(LAYER_NORM_MODES)
    assert build["ort_level"].choices == list(OPT_LEVELS)
    protocol = {"contract": DEFAULT_CONTRACT, "padding_ratio": DEFAULT_PADDING_RATIO, "warmups": DEFAULT_WARMUPS,
                "repeats": DEFAULT_REPEATS, "rounds": DEFAULT_ROUNDS}
    for actions in (build, bench):
        assert {k: actions[k].default for k in protocol} == protocol
    assert bench["processes"].default == DEFAULT_PROCESSES == BenchOptions("cpu", "float32").processes
    request = BuildRequest(None, None, None, None)
    assert {k: getattr(request, k) for k in protocol} == protocol
    assert {k: getattr(BenchOptions("cpu", "float32"), k) for k in protocol} == protocol


# Dated text: measurements, campaigns and tickets belong in docs/ (results.md); library code says what holds and why.
DATED = {
    "a campaign number": r"\bcampaigns?\s+\d+",
    "an issue number": r"\bissues?\s+#?\d+|\(#\d+\)",
    "a commit hash": r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    "a measured torch build": r"\btorch\s+\d+\.\d+\.\d+\+\w+",
}
DATED_TEXT_EXEMPT: tuple[str, ...] = ()


def library_files() -> list[Path]:
    files = [p for top in ("kkdeploy", "engines", "exporters", "validation") for p in sorted((ROOT / top).rglob("*.py"))]
    return [p for p in files if not p.relative_to(ROOT).as_posix().startswith(DATED_TEXT_EXEMPT)]


def test_library_code_carries_no_campaign_issue_or_commit_numbers():
    import re

    found = []
    for path in library_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in DATED.items():
                if re.search(pattern, line, flags=re.IGNORECASE if what != "a commit hash" else 0):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()[:80]}")
    assert not found, "dated text in library code (move it to docs/):\n" + "\n".join(found)


def test_the_dated_text_scan_sees_what_it_looks_for():
    import re

    for what, text in [("a campaign number", "Campaign 12 measured"), ("an issue number", "(issue 30)"),
                       ("a commit hash", "since `e4ffaff`"), ("a measured torch build", "on torch 2.11.0+cu130")]:
        assert re.search(DATED[what], text, flags=re.IGNORECASE if what != "a commit hash" else 0), what
    assert not re.search(DATED["a commit hash"], "the default cached64w4 launch, 4096 keys, float16")
