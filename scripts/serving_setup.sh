# Sourced, not run: puts the carried server and gRPC client (.whl/serving/, staged by scripts/serving_carry.sh and
# checked against SHA256SUMS) in place on the device and exports what kkdeploy needs to find them. Used by
# scripts/serving_h200.sh and the campaign's cli step. Returns 2, with the reason, when nothing is carried.
carried=.whl/serving
if [ ! -f "$carried/SHA256SUMS" ]; then
  echo "nothing carried: run scripts/serving_carry.sh here first, carry [\".whl\"]" >&2
  return 2
fi
(cd "$carried" && sha256sum --quiet -c SHA256SUMS) || return 2
mkdir -p /tmp/kk-triton /tmp/site
[ -x /tmp/kk-triton/pytriton/tritonserver/bin/tritonserver ] || tar -C /tmp/kk-triton -xJf "$carried/tritonserver.tar.xz"
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$carried"/*.whl 2>&1 | grep -v WARNING || true
# tritonclient's CUDA shared memory needs cuda-bindings: the carried one only where this Python has none (never over
# the one torch's environment may bring)
if [ -d "$carried/optional" ] && ! python3 -c "import cuda.bindings.runtime" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$carried"/optional/*.whl 2>&1 \
    | grep -v WARNING || true
fi
case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1 KKDEPLOY_TRITONSERVER=/tmp/kk-triton/pytriton/tritonserver
export KKDEPLOY_CACHE_DIR=${KKDEPLOY_CACHE_DIR:-/tmp/kk-cache}
