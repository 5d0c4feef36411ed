#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): the Q|K|V attention's study form whole_pv (each chunk
# pair's P.V as one 64-key dot) joins the build's proofs, which keep the fastest bit-identical form per op shape, as a
# launch-bound form (proven where the launch's programs fill at most two waves). Prints how many lines changed (2),
# and fails where one of them no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/whole_pv_joins_builds.sh"
set -e
qkv=kkdeploy/kernels/qkv_attention.py
append() {  # append(line head as sed reads it, tuple as it reads, name to append)
    sed -i "s/^$1($2)\(.*\)\$/$1($2, \"$3\")\1/" "$qkv"
}
append 'BUILD_LAUNCHES: tuple\[str, ...\] = ' '"whole", "pair", "whole_w8", "whole_em"' whole_pv
append 'LAUNCH_BOUND_FORMS, LAUNCH_BOUND_MAX_WAVES = ' '"whole_w8", "whole_em"' whole_pv
forms=$(grep -c '^BUILD_LAUNCHES: .*"whole_pv")$' "$qkv")
bound=$(grep -c '^LAUNCH_BOUND_FORMS, .*"whole_pv"), 2$' "$qkv")
echo $(( forms + bound ))
[ "$(( forms + bound ))" -eq 2 ]
