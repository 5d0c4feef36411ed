#!/usr/bin/env bash
# Issues 30 and 33 on the lent H200, in ONE device call (carry [".whl"], staged by scripts/serving_carry.sh):
#   bash scripts/serving_h200.sh            (BUDGET=seconds for the Python part, default 420)
# Installs the carried server and gRPC client (checked against SHA256SUMS) into /tmp, then runs
# scripts/serving_h200.py, which builds, serves, loads and measures, writes $OUT/serving-h200.json and prints its
# table last.
set -euo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/serving_setup.sh
. scripts/serving_setup.sh || exit 2
python3 -c "import sysconfig,sys; assert sysconfig.get_config_var('Py_ENABLE_SHARED'), 'no shared libpython: the Python-backend stub cannot embed this Python'; print(sys.version.split()[0], 'shared libpython ok')"
# kkdeploy's in-process backend (--engines inprocess, the default's first) is compiled here: a C++ compiler and Python.h
python3 -c "import sysconfig,os,shutil; h=os.path.join(sysconfig.get_paths()['include'],'Python.h'); print('in-process backend:', shutil.which(os.environ.get('CXX') or 'g++') or 'NO C++ COMPILER', '|', h if os.path.isfile(h) else 'NO Python.h')"
# system shared memory (loadtest --shared-memory system; shape 13 registers 64 MB per client) lives in /dev/shm
df -h /dev/shm | tail -1 | awk '{print "/dev/shm:", $2, "size,", $4, "free"}'
exec python3 scripts/serving_h200.py --out "$OUT" --budget "${BUDGET:-420}" "$@"
