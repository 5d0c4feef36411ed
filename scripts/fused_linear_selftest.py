#!/usr/bin/env python3
"""The linear kernel's GPU self-test: ``scripts/kernel_selftest.py --kinds linear``, the build's own proof step.

    python3 scripts/fused_linear_selftest.py --out OUT.json [--shapes 1 2 3] [--all-launches] [--weights-seed N]

A thin wrapper, so that the campaign and the build cannot disagree (docs/kernel-proofs.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_selftest import main as selftest_main  # noqa: E402


def main(argv=None) -> int:
    return selftest_main(["--kinds", "linear", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
