#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): the LayerNorm prologue's tiles (norm2 inside ffn_in,
# norm1 inside the packed Q|K|V; session 51, studies only) join the build's proofs, which keep the fastest
# bit-identical one per op shape; the block's plan then takes a prologue only where its proof's time is below the
# rows LayerNorm's and the plain GEMM's together. $NORM_TILES names the tiles (default: all five). Prints how many
# lines changed (1), and fails where the tuple no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/norm_prologue_joins_builds.sh"
set -e
linear=kkdeploy/kernels/fused_linear.py
tiles=${NORM_TILES:-ln_m64n32_w8 ln_m64n16_w8 ln_m32n32_w8 ln_m16n32 ln_m64_w8}
new=$(printf '"%s", ' $tiles)
new="(${new%, })"
sed -i "s/^NORM_BUILD_TILES: tuple\[str, ...\] = ()\$/NORM_BUILD_TILES: tuple[str, ...] = $new/" $linear
changed=$(grep -c "^NORM_BUILD_TILES: tuple\[str, ...\] = (\"ln_" $linear)
echo "$changed"
[ "$changed" -eq 1 ]
