#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): session 48's study launches join the build's proofs,
# which keep the fastest bit-identical launch per op shape. The narrower GEMM tiles (m64n32, m64n16, and the 32-row
# probe m32n32; small tiles, proven where "auto"'s grid leaves multiprocessors idle), the LayerNorm epilogue's
# regs_w16, regs_e, regs_m32 and regs_m16, and the Q|K|V attention's whole_w8 and whole_em. Prints how many lines
# changed (3), and fails where one of them no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/study_launches_join_builds.sh"
set -e
linear=kkdeploy/kernels/fused_linear.py
qkv=kkdeploy/kernels/qkv_attention.py
tiles='"auto", "m64", "n64", "n256", "m64s2", "m64n64", "cols", "m64s2cols"'
ln_tiles='"auto", "regs", "regs_w4"'
launches='"whole", "pair"'
add() {  # add(file, line head, tuple as it reads, names to append)
    sed -i "s/^$2 = ($3)\$/$2 = ($3, $4)/" "$1"
}
add $linear BUILD_TILES "$tiles" '"m64n32", "m64n16", "m32n32"'
add $linear LN_BUILD_TILES "$ln_tiles" '"regs_w16", "regs_e", "regs_m32", "regs_m16"'
add $qkv 'BUILD_LAUNCHES: tuple\[str, ...\]' "$launches" '"whole_w8", "whole_em"'
changed=$(( $(grep -c '^BUILD_TILES = .*"m32n32")$\|^LN_BUILD_TILES = .*"regs_m16")$' $linear)
            + $(grep -c '^BUILD_LAUNCHES.*"whole_em")$' $qkv) ))
echo "$changed"
[ "$changed" -eq 3 ]
