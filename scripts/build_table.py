#!/usr/bin/env python3
"""One markdown table over several `kkdeploy build` artifact directories (issue 20's per-shape tables).

    python3 scripts/build_table.py DIR... [--md T.md] [--json T.json]

A row per candidate: shape, candidate, status, failed elements (all trials, both mask modes), max abs error,
median ms (the build's own timing, same process as the fallback's), whether it shipped, the ORT CUDA EP's
TF32 setting (``cuda_ep_use_tf32``, recorded by the build) and the reason when it did not pass. Each shape
ends with the fallback's row, timed in the same process. A directory without a manifest (a build that
did not finish) is named once and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_for(manifest: dict) -> list[dict]:
    chosen = manifest["choice"]["candidate"]
    out = []
    names = {c["name"] for c in manifest["candidates"]}
    entries = manifest["candidates"] + [{"name": "fallback (PyTorch)", "status": "fallback", **manifest["fallback"]}]
    for c in entries:
        v = c.get("validation") or {}
        lat = c.get("latency") or {}
        opts = c.get("options") or {}
        out.append({
            "shape": manifest.get("shape_id"), "dtype": manifest.get("dtype"), "tf32": manifest.get("tf32"),
            "contract": manifest["validation"]["contract"], "candidate": c["name"], "status": c["status"],
            "failed_elements": v.get("failed_elements"), "max_abs": v.get("max_abs"),
            "median_ms": lat.get("median_ms"),
            "shipped": c["name"] == chosen or (c["status"] == "fallback" and chosen not in names),
            "cuda_ep_use_tf32": opts.get("cuda_ep_use_tf32"), "fp16_layers": opts.get("fp16_layers"),
            "build_seconds": c.get("build_seconds"),
            "reason": "" if c["status"] in ("passed", "fallback") else (c.get("reason") or "")[:90],
        })
    return out


def markdown(rows: list[dict]) -> str:
    head = ["shape", "candidate", "status", "failed", "max abs", "median ms", "shipped", "ORT use_tf32",
            "fp16 blocks", "reason"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fmt = lambda v, f="{}": "-" if v is None else f.format(v)  # noqa: E731
        lines.append("| " + " | ".join([
            fmt(r["shape"]), r["candidate"], r["status"], fmt(r["failed_elements"]), fmt(r["max_abs"], "{:.3g}"),
            fmt(r["median_ms"], "{:.3f}"), "**yes**" if r["shipped"] else "", fmt(r["cuda_ep_use_tf32"]),
            fmt(r["fp16_layers"]), r["reason"].replace("|", "/")]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for d in args.dirs:
        path = d / "manifest.json"
        if not path.is_file():
            print(f"{d}: no manifest.json (the build did not finish); skipped", file=sys.stderr)
            continue
        rows += rows_for(json.loads(path.read_text()))
    text = markdown(rows)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
