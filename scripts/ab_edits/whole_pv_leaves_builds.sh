#!/bin/bash
# An edit for scripts/ab_bench.py (run in a copy of the tree): the Q|K|V attention's whole_pv (each chunk pair's P.V
# as one 64-key dot; in builds since session 50) leaves the build's proofs and the launch-bound forms, so an A/B times
# the call with and without it (the edit side then proves whole_em where whole_pv won). Prints how many lines changed
# (2), and fails where one of them no longer reads as it did.
#
#   python3 scripts/ab_bench.py --shapes 3 --out /tmp/ab \
#       --edit "bash $PWD/scripts/ab_edits/whole_pv_leaves_builds.sh"
set -e
qkv=kkdeploy/kernels/qkv_attention.py
drop() {  # drop(line head as sed reads it, the tuple's names before it, as they read)
    sed -i "s/^$1($2, \"whole_pv\")\(.*\)\$/$1($2)\1/" "$qkv"
}
drop 'BUILD_LAUNCHES: tuple\[str, ...\] = ' '"whole", "pair", "whole_w8", "whole_em"'
drop 'LAUNCH_BOUND_FORMS, LAUNCH_BOUND_MAX_WAVES = ' '"whole_w8", "whole_em"'
forms=$(grep -c '^BUILD_LAUNCHES: tuple\[str, ...\] = ("whole", "pair", "whole_w8", "whole_em")$' "$qkv")
bound=$(grep -c '^LAUNCH_BOUND_FORMS, LAUNCH_BOUND_MAX_WAVES = ("whole_w8", "whole_em"), 2$' "$qkv")
echo $(( forms + bound ))
[ "$(( forms + bound ))" -eq 2 ]
