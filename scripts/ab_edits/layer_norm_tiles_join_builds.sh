#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): the LayerNorm epilogue's study tiles join the build's
# proofs (regs_w16, regs_e, regs_m32, regs_m16), which keep the fastest bit-identical one per op shape; the block's plan
# then decides whether the epilogue beats the residual GEMM and the rows LayerNorm apart. Prints how many lines changed
# (1), and fails where the tuple no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/layer_norm_tiles_join_builds.sh"
set -e
linear=kkdeploy/kernels/fused_linear.py
old='("auto", "regs", "regs_w4")'
new='("auto", "regs", "regs_w4", "regs_w16", "regs_e", "regs_m32", "regs_m16")'
sed -i "s/^LN_BUILD_TILES = $old\$/LN_BUILD_TILES = $new/" $linear
changed=$(grep -c '^LN_BUILD_TILES = (.*"regs_m16")$' $linear)
echo "$changed"
[ "$changed" -eq 1 ]
