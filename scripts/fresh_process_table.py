"""Every candidate of some artifact directories, loaded and called once in a fresh process: a table.

    python scripts/fresh_process_table.py DIR [DIR ...] [--out fresh-process.json] [--timeout 600]

For each manifest entry that was built (any status but unavailable/skipped/build-failed), this spawns the
same child as the build's fresh-process check (``engines.fresh_process.probe``): it loads the candidate with
its backend and computes its output fingerprint. The table says what happened (ok, load-crashed, load-hung,
load-failed), how long it took, and whether the fingerprint equals the one the build recorded (the
fresh-process check's, or torch-compile's load fingerprint, which its loader verifies itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engines import backend_module  # noqa: E402
from engines.base import FINGERPRINT_PADDING  # noqa: E402
from engines.fresh_process import OK, probe  # noqa: E402
from kkdeploy.config import TransformerConfig, parse_dtype  # noqa: E402
from kkdeploy.errors import KKError  # noqa: E402
from kkdeploy.pipeline.runtime import read_manifest  # noqa: E402

NOT_BUILT = ("unavailable", "skipped", "build-failed")


def rows_for(root: Path, timeout: float) -> list[dict]:
    manifest = read_manifest(root)
    config = TransformerConfig.from_dict(manifest["config"])
    dtype = parse_dtype(manifest["dtype"])
    device = torch.device(manifest["environment"]["device"]["type"])
    rows = []
    for entry in manifest["candidates"]:
        if entry["status"] in NOT_BUILT:
            continue
        options = entry.get("options") or {}
        ratios = FINGERPRINT_PADDING[:1] if options.get("all_valid_only") else FINGERPRINT_PADDING
        expected = (entry.get("fresh_process") or {}).get("fingerprint")
        outcome = probe(backend_module(entry["backend"]), root, entry, config, dtype, device,
                        tf32=bool(manifest.get("tf32")), padding_ratios=ratios, timeout_s=timeout)
        rows.append({"artifacts": str(root), "shape_id": manifest.get("shape_id"), "candidate": entry["name"],
                     "build_status": entry["status"], "fresh_process": outcome.status, "reason": outcome.reason,
                     "seconds": outcome.seconds,
                     "same_output": None if expected is None or not outcome.ok else outcome.fingerprint == expected,
                     "shipped": entry["name"] in (manifest["choice"]["candidate"],
                                                  manifest["choice"].get("padded_candidate"))})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    rows = []
    for root in args.dirs:
        try:
            rows += rows_for(root, args.timeout)
        except KKError as exc:  # one unreadable directory (a build that died) does not cost the others' rows
            print(f"skipped {root}: {exc}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    print("| shape | candidate | build status | fresh process | s | same output | shipped |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r["same_output"] is None else ("yes" if r["same_output"] else "NO")
        state = r["fresh_process"] if r["fresh_process"] == OK else r["reason"]
        print(f"| {r['shape_id']} | {r['candidate']} | {r['build_status']} | {state} | {r['seconds']:.1f} | {same} | "
              f"{'yes' if r['shipped'] else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
