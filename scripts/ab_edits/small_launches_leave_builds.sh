#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): the launches that joined the build's proofs for the
# launch-bound shapes leave them again, so an A/B times the tree as it was before they joined. The narrower GEMM tiles
# (m64n32, m64n16 and the 32-row m32n32) and the Q|K|V attention's whole_w8, whole_em and whole_pv. Prints how many
# lines changed (2), and fails where one of them no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/small_launches_leave_builds.sh"
set -e
linear=kkdeploy/kernels/fused_linear.py
qkv=kkdeploy/kernels/qkv_attention.py
drop() {  # drop(file, line head, names to remove as they read at the tuple's end)
    sed -i "s/^\($2 = (.*\), $3)\$/\1)/" "$1"
}
drop $linear BUILD_TILES '"m64n32", "m64n16", "m32n32"'
drop $qkv 'BUILD_LAUNCHES: tuple\[str, ...\]' '"whole_w8", "whole_em", "whole_pv"'
changed=$(( $(grep -c '^BUILD_TILES = ("auto", .*"m64s2cols")$' $linear)
            + $(grep -c '^BUILD_LAUNCHES: tuple\[str, ...\] = ("whole", "pair")$' $qkv) ))
echo "$changed"
[ "$changed" -eq 2 ]
