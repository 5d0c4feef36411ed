#!/usr/bin/env python3
"""Which unproven kernel parts a GPU self-test has just shown bit-identical AND faster here, as shell lines.

Why: a GPU session is short. This reads the reports of ``scripts/fused_linear_selftest.py`` and
``scripts/faithful_attention_selftest.py`` from the same machine and prints the environment that lets the
kernels use what passed, so one run can prove a part and benchmark with it (``scripts/h200_campaign.sh``'s
``promote`` step writes it to ``$WORK/proven.env``, and its ``bench`` step reads that file). The bench and the
build still validate every output. A part goes into the code (``PROVEN_EPILOGUES``, ``EPILOGUE_FLAGS``,
``DEFAULT_LAUNCH``) only in a commit that cites the report.

    python3 scripts/proven_parts.py --linear fused-linear.json --attention faithful_attention_selftest.json

The rules (each one printed as a comment with its numbers):
* ``layer_norm``: 0 differing in the LayerNorm emulation and both LayerNorm epilogues, every model and random
  check; faster on shape 6 than our residual GEMM followed by the rows LayerNorm kernel.
* ``gelu_prologue`` (contraction off, else on as ``gelu_prologue:fp_fusion``): 0 differing over every float16
  value (exhaustive) and in every model and random check, also in ffn_out's whole launch with the LayerNorm
  epilogue when ``layer_norm`` passed; faster on shape 6 than our GEMM, ATen's GELU and our GEMM.
* ``gelu`` (the epilogue; only when the prologue did not pass): the same checks; faster than ATen's Linear + GELU.
* the attention launch: 0 differing on every shape it fits, all-valid and padded, model and random inputs;
  on shape 6 (padded) at least 3% faster than the op's launch, and no more than 5% slower on any other timed shape.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kkdeploy.kernels.faithful_attention import DEFAULT_LAUNCH, LAUNCH_ENV, launch_fits  # noqa: E402
from kkdeploy.kernels.fused_linear import PARTS_ENV  # noqa: E402

OFFICIAL = range(1, 14)
TIMING_SHAPE = 6


def _total(rows: list[dict], form: str) -> tuple[int, int]:
    """(differing, calls) of ``form`` over the model and random checks."""
    differing = calls = 0
    for r in rows:
        if r.get("check") in ("model", "random") and form in r.get("forms", {}):
            differing += r["forms"][form]["differing"]
            calls += r["forms"][form]["calls"]
    return differing, calls


def _exhaustive(rows: list[dict], prologue: bool, fusion: bool):
    for r in rows:
        if r.get("check") == "gelu_exhaustive" and bool(r.get("prologue")) == prologue \
                and bool(r.get("enable_fp_fusion")) == fusion:
            return r["differing"]
    return None


def linear_parts(report: dict) -> tuple[list[str], list[str]]:
    """(accepted parts as PARTS_ENV entries, one reason line per decision)."""
    rows = report.get("rows", [])
    shapes = {r["shape"] for r in rows if r.get("check") == "model"}
    timing = next((r for r in rows if r.get("check") == "timing" and r.get("shape") == TIMING_SHAPE), {})
    if not set(OFFICIAL) <= shapes:
        return [], [f"linear: the report covers shapes {sorted(shapes)}, not 1-13: nothing taken"]
    accepted, notes = [], []

    def bitwise(forms) -> tuple[bool, str]:
        seen = [(f, *_total(rows, f)) for f in forms]
        ok = all(calls and not diff for _, diff, calls in seen)
        return ok, ", ".join(f"{f} {diff} differing in {calls} calls" for f, diff, calls in seen)

    def faster(ours: str, theirs: str) -> tuple[bool, str]:
        a, b = timing.get(ours), timing.get(theirs)
        if a is None or b is None:
            return False, f"no timing of {ours} / {theirs} on shape {TIMING_SHAPE}"
        return a < b, f"shape {TIMING_SHAPE}: {a:.4f} ms against {b:.4f} ms"

    ok, why = bitwise(["ln_emulation", "add_masked_ln", "masked_sum_ln"])
    quick, when = faster("kernel_masked_sum_ln_bm64_w8_reload_ms", "separate_masked_sum_then_ln_ms")
    layer_norm = ok and quick
    notes.append(f"layer_norm: {'taken' if layer_norm else 'not taken'} ({why}; {when})")
    if layer_norm:
        accepted.append("layer_norm")

    for prologue, part, timed in ((True, "gelu_prologue", "kernel_ffn_gelu_prologue{}_ms"),
                                  (False, "gelu", "kernel_gelu_ms")):
        if not prologue and any(p.startswith("gelu_prologue") for p in accepted):
            notes.append("gelu: not needed (the prologue was taken)")
            continue
        for fusion in (False, True):
            suffix = "_fpfusion" if fusion else ""
            forms = [part + suffix] + ([f"gelu_prologue_ln{suffix}"] if prologue and layer_norm else [])
            ok, why = bitwise(forms)
            every = _exhaustive(rows, prologue, fusion)
            ok = ok and every == 0
            quick, when = faster(timed.format(suffix), "kernel_ffn_aten_gelu_ms" if prologue else "aten_gelu_ms")
            name = part + (":fp_fusion" if fusion else "")
            notes.append(f"{name}: {'taken' if ok and quick else 'not taken'} (every float16 value: {every} "
                         f"differing; {why}; {when})")
            if ok and quick:
                accepted.append(name)
                break
    return accepted, notes


def attention_launch(report: dict) -> tuple[str | None, list[str]]:
    """(the launch to take, or None; reason lines)."""
    shapes = {int(k): v for k, v in report.get("shapes", {}).items()}
    if not set(OFFICIAL) <= set(shapes):
        return None, [f"attention: the report covers shapes {sorted(shapes)}, not 1-13: nothing taken"]
    base_key = f"{DEFAULT_LAUNCH}_ms"
    names = sorted({n for e in shapes.values() for n, cell in e.get("model_padded", {}).items()
                    if isinstance(cell, dict) and "differing" in cell and n not in ("op", DEFAULT_LAUNCH)})
    best, best_ms, notes = None, None, []
    for name in names:
        bad, missing, slower = [], [], []
        for sid, e in sorted(shapes.items()):
            if "error" in e:
                missing.append(sid)
                continue
            if not launch_fits(name, e["config"]["seq_len"]):
                continue
            for key in ("model_all_valid", "model_padded", "random_all_valid", "random_padded"):
                cell = e.get(key, {}).get(name)
                if cell is None:
                    missing.append(f"{sid} {key}")
                elif cell["differing"]:
                    bad.append(f"{sid} {key} {cell['differing']}")
            t = e.get("time_padded", {})
            if f"{name}_ms" in t and base_key in t and sid != TIMING_SHAPE and t[f"{name}_ms"] > 1.05 * t[base_key]:
                slower.append(f"{sid}: {t[f'{name}_ms']:.4f} against {t[base_key]:.4f} ms")
        t6 = shapes.get(TIMING_SHAPE, {}).get("time_padded", {})
        ms, base = t6.get(f"{name}_ms"), t6.get(base_key)
        quick = ms is not None and base is not None and ms < 0.97 * base
        ok = not bad and not missing and quick and not slower
        notes.append(f"launch {name}: {'bitwise' if not bad and not missing else 'NOT bitwise'} "
                     f"(differing: {bad or 'none'}; unchecked: {missing or 'none'}); shape {TIMING_SHAPE} padded "
                     f"{ms} against {DEFAULT_LAUNCH} {base} ms; slower elsewhere: {slower or 'none'}"
                     f" -> {'a candidate' if ok else 'not taken'}")
        if ok and (best_ms is None or ms < best_ms):
            best, best_ms = name, ms
    return best, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--linear", help="scripts/fused_linear_selftest.py's JSON report")
    ap.add_argument("--attention", help="scripts/faithful_attention_selftest.py's JSON report")
    args = ap.parse_args(argv)
    lines = []
    for path, decide in ((args.linear, "linear"), (args.attention, "attention")):
        if not path:
            continue
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"proven_parts: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if decide == "linear":
            parts, notes = linear_parts(report)
            lines += [f"# {n}" for n in notes]
            if parts:
                lines.append(f"export {PARTS_ENV}={shlex.quote(','.join(parts))}")
        else:
            launch, notes = attention_launch(report)
            lines += [f"# {n}" for n in notes]
            if launch:
                lines.append(f"export {LAUNCH_ENV}={shlex.quote(launch)}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
