#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): session 48's study launches join the build's proofs,
# which keep the fastest bit-identical launch per op shape. The narrower GEMM tiles (m64n32, m64n16, and the 32-row
# probe m32n32; small tiles, proven where "auto"'s grid leaves multiprocessors idle), the LayerNorm epilogue's
# regs_w16, regs_e, regs_m32 and regs_m16, and the Q|K|V attention's whole_w8 and whole_em. Prints how many lines
# changed (3), and fails where one of them no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab --edit "bash $PWD/scripts/ab_edits/study_launches_join_builds.sh"
set -e
linear=kkdeploy/kernels/fused_linear.py
qkv=kkdeploy/kernels/qkv_attention.py
sed -i 's/^BUILD_TILES = ("auto", "m64", "n64", "n256", "m64s2", "m64n64", "cols", "m64s2cols")$/BUILD_TILES = ("auto", "m64", "n64", "n256", "m64s2", "m64n64", "cols", "m64s2cols", "m64n32", "m64n16", "m32n32")/' $linear
sed -i 's/^LN_BUILD_TILES = ("auto", "regs", "regs_w4")$/LN_BUILD_TILES = ("auto", "regs", "regs_w4", "regs_w16", "regs_e", "regs_m32", "regs_m16")/' $linear
sed -i 's/^BUILD_LAUNCHES: tuple\[str, ...\] = ("whole", "pair")$/BUILD_LAUNCHES: tuple[str, ...] = ("whole", "pair", "whole_w8", "whole_em")/' $qkv
changed=$(( $(grep -c '^BUILD_TILES = .*"m32n32")$\|^LN_BUILD_TILES = .*"regs_m16")$' $linear) + $(grep -c '^BUILD_LAUNCHES.*"whole_em")$' $qkv) ))
echo "$changed"
[ "$changed" -eq 3 ]
