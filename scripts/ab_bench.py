"""A/B of a code change under ``kkdeploy bench``, with our kernels' plan held the same on every side.

    python3 scripts/ab_bench.py --edit "sed -i 's/^MASKED_FINAL = False$/MASKED_FINAL = True/' \\
        kkdeploy/kernels/layer_norm.py" --shapes 3,7 --out /tmp/ab

Per shape, one bench process per side in the order given (default: as committed, edited, as committed again, so
that drift shows up between the two unchanged runs), the same weights on every side (``scripts/make_weights.py``,
seed ``--weights-seed`` + shape). The edit is a shell command run in a copy of the repository's files.

Why the plan is held: our kernels' plan comes from the proofs, and a side that proves anew draws another plan
wherever the proofs time ours and ATen's close together. In session 46 (one H100, a proof cache per side) every
edited side ran shape 3 with 20 launches and every committed side with 24, so the A/B measured two plans, not the
edit. Here every later side starts from a copy of the first side's proof cache (``KKDEPLOY_CACHE_DIR``): an op whose
kernel the edit changes has another proof key and is proven again, every other op keeps its record. The table still
compares the sides' plans (``kkdeploy.pipeline.bench.kernel_plan``) and names any choice that differs, and counts per
side the op shapes whose proof record is not the first side's (proven again there; ``ab.json`` names them).

A second table gives each side's call timeline, as the bench records it on a GPU (``kkdeploy.pipeline.timeline``):
the span, busy time and gaps between kernels. A third aligns each later side's kernels with the first side's by name
and lists where the time moved (``compare_timelines``): a fused run against the launches it replaced, and matched
launches that got slower or faster. That says whether an edit that removes a launch also stopped the next one
starting early, which the medians alone cannot. ``--profile`` also profiles each side's candidates in the same
tree and cache (``scripts/profile_candidate.py``: kernel classes, the top kernels and a Chrome trace per candidate).

Writes ``ab.json`` and ``ab.md`` under ``--out`` (and each side's bench folder and log), and prints the table last.
Exit status: 0, or 2 with one line for bad input (an edit that fails or changes nothing, an unknown shape).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kkdeploy.pipeline.bench import kernel_plan, plan_difference  # noqa: E402
from kkdeploy.pipeline.timeline import TABLE_HEADER, compare_timelines, table_cells  # noqa: E402

DEFAULT_CANDIDATES = "torch-compile-faithful-gemms,torch-compile-faithful-gemms-pdl"


class BadInput(Exception):
    """A one-line reason the A/B cannot run as asked."""


def side_labels(order: list[str]) -> list[str]:
    """["base", "edit", "base"] -> ["base", "edit", "base2"]: one folder and one cache per side."""
    labels, seen = [], {}
    for side in order:
        if side not in ("base", "edit"):
            raise BadInput(f"--order takes base and edit, got {side!r}")
        seen[side] = seen.get(side, 0) + 1
        labels.append(side if seen[side] == 1 else f"{side}{seen[side]}")
    if "edit" not in seen or "base" not in seen:
        raise BadInput("--order needs at least one base and one edit side, e.g. base,edit,base")
    return labels


def repository_files(root: Path) -> list[str]:
    """The files a copy of the tree needs: tracked ones and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, check=True, capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if line and (root / line).is_file()]


def edited_tree(root: Path, dest: Path, edit: str) -> list[str]:
    """Copy the repository's files to ``dest``, run ``edit`` there; return the files it changed (relative paths)."""
    if dest.exists():
        shutil.rmtree(dest)
    files = repository_files(root)
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    before = {name: (dest / name).read_bytes() for name in files}
    proc = subprocess.run(edit, shell=True, cwd=dest, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BadInput(f"the edit exited {proc.returncode} in the copy: {(proc.stderr or proc.stdout).strip()[-200:]}")
    changed = [name for name in files if not (dest / name).is_file() or (dest / name).read_bytes() != before[name]]
    if not changed:
        raise BadInput(f"the edit changed no file in the copy: {edit}")
    return changed


def run_bench(cmd: list[str], cwd: Path, env: dict, log: Path) -> int:
    """One bench process (the A/B's unit of measurement); its output goes to ``log``."""
    with open(log, "w") as handle:
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode


def side_result(bench_json: Path) -> dict:
    """{candidate: {status, median_ms, failed, launches, plan, proofs, timeline}} from one side's bench.json ({} if
    none); ``proofs``: {op shape: its proof record} (``proof_key``); ``timeline``: the call's timeline the bench
    recorded (on a GPU; ``kkdeploy.pipeline.timeline``), else None."""
    if not bench_json.is_file():
        return {}
    shape = json.loads(bench_json.read_text())["shapes"][0]
    return {name: {"status": b.get("status"), "median_ms": b.get("median_ms"),
                   "failed": b.get("failed_elements"), "launches": (b.get("roofline") or {}).get("launches"),
                   "plan": kernel_plan(b), "proofs": {proof_key(r): r for r in b.get("kernel_proofs") or []},
                   "timeline": b.get("timeline")}
            for name, b in shape["backends"].items() if name != "eager"}


def proof_key(record: dict) -> str:
    """An op shape, readably, its fields in name order: 'fused_linear form=add_masked k=128 m=512 n=128'."""
    shape = record.get("shape") or {}
    return " ".join([str(record.get("op")), *(f"{k}={shape[k]}" for k in sorted(shape) if k != "dtype")])


def proven_anew(first: dict, side: dict) -> list[str]:
    """The op shapes whose record on ``side`` is not the first side's: proven (and timed) again there. Every later
    side starts from the first side's cache, so an edit should prove again only the launches it changes; more, and
    its plan may differ elsewhere too (session 51's A/B proved every GEMM again: one digest then keyed all the GEMM
    op's tile families)."""
    return sorted(key for key, record in side.items() if first.get(key) != record)


def verdict(edit_ms: list[float], base_ms: list[float]) -> str:
    """'faster' where every edited side beat every committed side by more than the committed sides' own spread (the
    drift between two runs of one tree), 'slower' the other way, else 'within the drift'. Beating both committed
    sides is not enough: session 47's shape 7 ran 0.0860 / 0.0852 / 0.1051 ms (as committed / edited / as committed
    again), and the edit's launch never ran in that plan."""
    if not edit_ms or not base_ms:
        return "not timed"
    drift = max(base_ms) - min(base_ms)
    if max(edit_ms) < min(base_ms) - drift:
        return "faster"
    if min(edit_ms) > max(base_ms) + drift:
        return "slower"
    return "within the drift"


def compare(shape: str, labels: list[str], results: dict[str, dict]) -> list[dict]:
    """One row per candidate: each side's ms and launches, whether the plan was held, the verdict."""
    rows = []
    names = [n for label in labels for n in results.get(label, {})]
    for name in dict.fromkeys(names):
        sides = {label: results.get(label, {}).get(name, {}) for label in labels}
        plans = [s.get("plan") for s in sides.values() if s.get("plan") is not None]
        held = all(p == plans[0] for p in plans)
        ms = {label: s.get("median_ms") for label, s in sides.items()}
        first = sides[labels[0]].get("proofs") or {}
        anew = {label: proven_anew(first, s.get("proofs") or {}) for label, s in sides.items() if label != labels[0]}
        timelines = {label: s.get("timeline") for label, s in sides.items()}
        base_timeline = timelines.get(labels[0]) or {}
        moved = {label: compare_timelines(base_timeline, t) for label, t in timelines.items()
                 if label != labels[0] and (t or {}).get("positions") and base_timeline.get("positions")}
        rows.append({"shape": shape, "candidate": name, "proven_anew": anew,
                     "timeline": timelines, "timeline_changes": moved,
                     "ms": ms, "launches": {label: s.get("launches") for label, s in sides.items()},
                     "failed": {label: s.get("failed") for label, s in sides.items()},
                     "plan_held": held, "plan_difference": "" if held else plan_difference(plans),
                     "verdict": verdict([v for k, v in ms.items() if k.startswith("edit") and v],
                                        [v for k, v in ms.items() if k.startswith("base") and v])})
    return rows


def markdown(rows: list[dict], labels: list[str], edit: str, changed: list[str]) -> str:
    lines = [f"edit: `{edit}` (changed: {', '.join(changed)})", "",
             "| shape | candidate | " + " | ".join(f"{label} ms (launches)" for label in labels)
             + " | op shapes proven anew | plan held | verdict |", "|---|---|" + "---|" * len(labels) + "---|---|---|"]
    for r in rows:
        cells = []
        for label in labels:
            ms, launches = r["ms"][label], r["launches"][label]
            cells.append("-" if ms is None else f"{ms:.4f}" + (f" ({launches})" if launches is not None else ""))
        held = "yes" if r["plan_held"] else f"**no**: {r['plan_difference']}"
        anew = ", ".join(f"{label} {len(keys)}" for label, keys in r.get("proven_anew", {}).items())
        lines.append(f"| {r['shape']} | {r['candidate']} | " + " | ".join(cells)
                     + f" | {anew} | {held} | {r['verdict']} |")
    timelines = [(r, label, (r.get("timeline") or {}).get(label)) for r in rows for label in labels]
    if any(t for _, _, t in timelines):
        lines += ["", "Each call's timeline under the profiler (µs, medians over the calls profiled): kernels a call, "
                  "span, busy, gaps between kernels, overlap of dependent launches, the largest gap", "",
                  f"| shape | candidate | side | {TABLE_HEADER} |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['candidate']} | {label} | {table_cells(t)} |" for r, label, t in timelines if t]
    changes = [(r, label, segments) for r in rows for label, segments in (r.get("timeline_changes") or {}).items()]
    if any(segments for _, _, segments in changes):
        lines += ["", f"Where the time moved against {labels[0]} (kernels aligned by name; each kernel's median plus "
                  "the gap after it, µs; the six largest changes a side)", "",
                  "| shape | candidate | side | change | kernels there | kernels here | µs there | µs here | Δ µs |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r, label, segments in changes:
            for seg in segments[:6]:
                there = ", ".join(f"{i}:{k[:28]}" for i, k in zip(seg["base"], seg["base_kernels"])) or "-"
                here = ", ".join(f"{i}:{k[:28]}" for i, k in zip(seg["other"], seg["other_kernels"])) or "-"
                lines.append(f"| {r['shape']} | {r['candidate']} | {label} | {seg['kind']} | {there} | {here} | "
                             f"{seg['base_us']:.2f} | {seg['other_us']:.2f} | {seg['delta_us']:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, bench: Callable[[list[str], Path, dict, Path], int] = run_bench) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edit", required=True, help="shell command run in a copy of the repository's files")
    parser.add_argument("--shapes", default="3", help="official shape ids, comma-separated (default 3)")
    parser.add_argument("--candidates", default=DEFAULT_CANDIDATES)
    parser.add_argument("--order", default="base,edit,base", help="the sides in the order they run")
    parser.add_argument("--weights-seed", type=int, default=700, help="make_weights seed = this + shape id")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--contract", default="strict", choices=("strict", "judge"))
    parser.add_argument("--bench-args", default="", help="more kkdeploy bench options, e.g. \"--repeats 50\"")
    parser.add_argument("--profile", action="store_true", help="after each side's bench, profile its candidates in "
                        "the same tree and cache (kernel classes, top kernels, Chrome traces)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        labels = side_labels([s.strip() for s in args.order.split(",") if s.strip()])
        shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        bad = [s for s in shapes if not s.isdigit() or not 1 <= int(s) <= 14]
        if bad or not shapes:
            raise BadInput(f"--shapes takes official shape ids 1-14, got {args.shapes!r}")
        args.out.mkdir(parents=True, exist_ok=True)
        changed = edited_tree(ROOT, args.out / "tree-edit", args.edit)
    except BadInput as exc:
        print(f"ab_bench: {exc}", file=sys.stderr)
        return 2
    print(f"edited copy: {', '.join(changed)}", flush=True)
    rows = []
    for shape in shapes:
        weights = args.out / f"w{shape}.safetensors"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_weights.py"), "--shape", shape, "--seed",
                        str(args.weights_seed + int(shape)), "--out", str(weights)], check=True,
                       capture_output=True)
        results, exits = {}, {}
        for index, label in enumerate(labels):
            tree = args.out / "tree-edit" if label.startswith("edit") else ROOT
            cache = args.out / f"cache-{label}-{shape}"
            if cache.exists():
                shutil.rmtree(cache)
            if index:  # the plan held: every later side starts from the first side's proof records
                first = args.out / f"cache-{labels[0]}-{shape}"
                if first.exists():
                    shutil.copytree(first, cache)
            env = dict(os.environ, KKDEPLOY_CACHE_DIR=str(cache),
                       PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
            folder = args.out / f"{label}-{shape}"
            if folder.exists():  # an earlier A/B's bench.json must not stand in for a side that wrote none
                shutil.rmtree(folder)
            cmd = [sys.executable, "-m", "kkdeploy", "bench", "--shape", shape, "--device", args.device, "--dtype",
                   args.dtype, "--contract", args.contract, "--processes", "1", "--weights", str(weights),
                   "--candidates", args.candidates,
                   "--out", str(folder), *shlex.split(args.bench_args)]
            code = bench(cmd, tree, env, args.out / f"{label}-{shape}.log")
            print(f"shape {shape} {label}: exit {code} ({shlex.join(cmd[1:4])} ...)", flush=True)
            if args.profile:  # the same tree and cache: the plan the bench timed, proven already
                prof = [sys.executable, str(tree / "scripts" / "profile_candidate.py"), "--shape", shape, "--device",
                        args.device, "--dtype", args.dtype, "--contract", args.contract, "--weights", str(weights),
                        "--candidate", args.candidates, "--calls", "20", "--warmups", "10",
                        "--out", str(folder / "profile")]
                pcode = bench(prof, tree, env, args.out / f"{label}-{shape}-profile.log")
                print(f"shape {shape} {label}: profile exit {pcode}", flush=True)
            results[label], exits[label] = side_result(folder / "bench.json"), code
        rows += [dict(row, exits=exits) for row in compare(shape, labels, results)]
    (args.out / "ab.json").write_text(json.dumps({"edit": args.edit, "changed": changed, "sides": labels,
                                                  "rows": rows}, indent=1, default=str))
    table = markdown(rows, labels, args.edit, changed)
    (args.out / "ab.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
