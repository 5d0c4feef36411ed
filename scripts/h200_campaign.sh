#!/usr/bin/env bash
# The H200 runs behind the issue notes, as steps: bash scripts/h200_campaign.sh STEP[=SECONDS]...
#
# Run on a GPU machine (an H200 with torch 2.11.0+cu130 so far) from the repository root (see ../shared/gpu/README.md for bringing
# onnxruntime-gpu and polygraphy to /tmp/site first). Everything lands under $OUT (at most 8 files):
#   campaign.log     every step's output, in order
#   builds.tgz       manifest/validation/bench/latency.png of each `kkdeploy build` (no engines)
#   fidelity.json    scripts/onnx_fidelity.py (ORT CUDA EP variants x levels x CUDA graphs)
#   inductor.json    scripts/inductor_h200.py (AOTInductor variants)
#   shape14.json     scripts/shape14_h200.py (full logical shape 14)
#   bench-DT-CT.tgz  kkdeploy bench output per shape (json, md, png, logs), DT dtype, CT contract
#   summary-DT-CT.md scripts/bench_summary.py over those: best passing backend per shape, geomeans
#   profile.tgz      scripts/profile_candidate.py per shape: kernel classes and top kernels, Chrome traces
#   crashproof.tgz, fresh-process.json  issue 17's builds (manifests) and scripts/fresh_process_table.py
#   custom-ops.json, ortstrict.md/json, ortjudge.md/json  issue 20: op table, FP16 strict ORT, float32 judge ORT
#   shape14-tiles.json  scripts/shape14_tile_study.py (issue 19: shape 14's tile profile and bitwise skips)
#   block-softmax.json  scripts/block_softmax_selftest.py (issue 19: ATen's block softmax order, the fused kernel)
#   scores-softmax.json scripts/scores_softmax_study.py (issue 29: the attention without stored scores, Triton)
#   layer-norm.json, attention.json, fused-linear.json  scripts/kernel_selftest.py per kind: the build's proof step
#                    over the official shapes, every launch variant (bitwise or not, and timed against ATen)
#   prove-N.json     `kkdeploy prove` per shape: the build's proof step on its own (which kernels, which launches)
#   custom.tgz, custom.md  the custom-shape step: builds and benches of non-official shapes with our own weights
#   customprofile/   where the time goes on non-official shapes: the proof's records and a kernel profile per candidate
#   pdl.tgz, pdl.md  the launch-bound shapes with and without programmatic dependent launches, one process each
#   ncu.tgz          Nsight Compute per kernel (scripts/ncu_profile.py): ncu.csv, ncu.json, ncu.md per shape
#   gather.json      scripts/serving_gather_study.py: where a batch-1 request's gather goes in the in-process backend
#   ab.tgz           scripts/ab_bench.py per edit under scripts/ab_edits: the benches with their call timelines
#   (cli: a new user's builds, runs and mistakes with the real CLI, into campaign.log only)
# Steps: env, setup, crashproof, selfcheck, build, fidelity, inductor, shape14, shape14tiles, blocksoftmax, layernorm, linear,
# attention, prove, custom, customprofile, pdl, bench, profile, customops, ortstrict, ortjudge, shape14build, layers, buildtime,
# scoresoftmax, inductoronly, ncu, gather, cli, ab. A step's =SECONDS caps its wall time.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KKDEPLOY_CACHE_DIR=${KKDEPLOY_CACHE_DIR:-/tmp/kk-cache}
# The GPU machine cannot reach Debian for ONNX Runtime's C API headers (the custom-op library compiles against them):
# carry them as .whl/ort-include (cp -r ~/.cache/kkdeploy/ort-headers/*/include .whl/ort-include on a networked machine).
if [ -z "${KKDEPLOY_ORT_INCLUDE:-}" ] && [ -f .whl/ort-include/onnxruntime_c_api.h ]; then
  export KKDEPLOY_ORT_INCLUDE=$PWD/.whl/ort-include
fi
WORK=${WORK:-/tmp/kk-work}
mkdir -p "$WORK"
log="$OUT/campaign.log"
BUILD_SHAPES=${BUILD_SHAPES:-2 3 12}  # BUILD_DTYPE (float16), BUILD_BACKENDS, BUILD_ARGS (extra flags)
# CAMPAIGN_DEVICE=cpu runs a step's commands on the CPU: a dry run of its plumbing (flags, files, summaries) before
# device time is spent on it; the kernel self-tests need a GPU and say so.
DEVICE=${CAMPAIGN_DEVICE:-cuda}
export OUT WORK BUILD_SHAPES DEVICE

step_env() {
  [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -m kkdeploy env --device "$DEVICE"  # every backend, kernel and serving part: ready, or why not
}

step_build() {
  for s in $BUILD_SHAPES; do
    python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --dtype "${BUILD_DTYPE:-float16}" --force ${BUILD_ARGS:-} \
      --backends "${BUILD_BACKENDS:-trt,ort-cuda,torch-graph}" --out "$WORK/shape-$s" || echo "build shape $s: exit $?"
  done
  (cd "$WORK" && tar czf "$OUT/builds.tgz" --exclude='*.onnx' --exclude='*.plan' --exclude='*.pt2' \
     --exclude='*.safetensors' shape-*)
  for s in $BUILD_SHAPES; do python3 -m kkdeploy run --artifacts "$WORK/shape-$s" --padding-ratio 0.25 || true; done
}

step_crashproof() {
  # Issue 17 on the GPU: an inductor-only build survives its crashing loader (run alongside, it compiles on
  # the CPU); a default build serves padded calls in 5 fresh processes; every built candidate of shapes 2, 3
  # and 12 is then loaded once more in a fresh process (scripts/fresh_process_table.py).
  ( python3 -m kkdeploy build --shape 3 --device "$DEVICE" --force --backends inductor --out "$WORK/s3-inductor" \
      > "$WORK/s3-inductor.log" 2>&1; echo "CRASHPROOF inductor-only build exit $?" >> "$WORK/s3-inductor.log" ) &
  python3 -m kkdeploy build --shape 3 --device "$DEVICE" --force --out "$WORK/s3-default"
  echo "CRASHPROOF default build exit $?"
  for i in 1 2 3 4 5; do
    python3 -m kkdeploy run --artifacts "$WORK/s3-default" --padding-ratio 0.25; echo "CRASHPROOF run $i exit $?"
  done
  for s in ${CRASHPROOF_SHAPES:-2 12}; do
    python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --force --out "$WORK/s$s"; echo "CRASHPROOF build shape $s exit $?"
  done
  wait; cat "$WORK/s3-inductor.log"
  (cd "$WORK" && tar czf "$OUT/crashproof.tgz" --exclude='*.pt2' --exclude='*.safetensors' --exclude='*.inductor-cache' \
     --exclude='*.onnx' s3-inductor s3-default s2 s12 s3-inductor.log)
  python3 scripts/fresh_process_table.py "$WORK/s3-inductor" "$WORK/s3-default" "$WORK/s2" "$WORK/s12" \
    --out "$OUT/fresh-process.json"
}

step_inductoronly() {
  # Issue 17's first command alone: every AOTInductor package is probed in a fresh process.
  python3 -m kkdeploy build --shape 3 --device "$DEVICE" --force --backends inductor --out "$WORK/s3-inductor"
  echo "CRASHPROOF inductor-only build exit $?"
  python3 -c "import json; m = json.load(open('$WORK/s3-inductor/manifest.json')); [print('FRESH', c['name'], c['status'], c['reason'], c.get('fresh_process', {}).get('seconds')) for c in m['candidates']]; print('CHOICE', m['choice'])"
  (cd "$WORK" && tar czf "$OUT/inductor-only.tgz" --exclude='*.pt2' --exclude='*.safetensors' --exclude='*.onnx' s3-inductor)
}

step_selfcheck() { python3 scripts/gpu_selfcheck.py --shape "${SELFCHECK_SHAPE:-3}"; }
step_fidelity() { python3 scripts/onnx_fidelity.py --out "$OUT/fidelity.json" ${FIDELITY_ARGS:-}; }
step_inductor() {
  # Find a load mode that works on this GPU first (a bad one segfaults), then run the sweep with it.
  best=$(python3 scripts/inductor_probe.py --shape 3 | tee /dev/stderr | sed -n 's/^BEST //p')
  if [ -z "$best" ] || [ "$best" = NONE ]; then echo "no AOTInductor load mode works here"; return 1; fi
  env $best python3 scripts/inductor_h200.py --out "$OUT/inductor.json" ${INDUCTOR_ARGS:-}
}
step_shape14() { python3 scripts/shape14_h200.py --out "$OUT/shape14.json" ${SHAPE14_ARGS:-}; }
step_blocksoftmax() {
  # Issue 19: ATen's block softmax order (emulation vs torch.softmax) and the fused causal kernel, bitwise.
  python3 scripts/block_softmax_selftest.py --out "$OUT/block-softmax.json" ${BLOCKSOFTMAX_ARGS:-}
}
step_scoresoftmax() {
  # Issue 29: shape 14's attention without stored scores (Triton), bitwise against the shipped composition, timed.
  python3 scripts/scores_softmax_study.py --out "$OUT/scores-softmax.json" ${SCORESOFTMAX_ARGS:-}
}
step_shape14build() {
  # Issue 29: `kkdeploy build --shape 14` as a user runs it (kernel proof, reduced + full-length validation), then
  # `kkdeploy run` on the artifact, all-valid and padded 0.25, full size (B32/S100000), 2 sequences checked against
  # the tiled reference. SHAPE14_WEIGHTS: "seeded" and/or "trained" (scripts/make_weights.py, seed SHAPE14_SEED,
  # default 77).
  for w in ${SHAPE14_WEIGHTS:-seeded trained}; do
    wargs=""
    if [ "$w" = trained ]; then
      wfile="$WORK/w14-trained-${SHAPE14_SEED:-77}.safetensors"
      [ -f "$wfile" ] || python3 scripts/make_weights.py --shape 14 --seed "${SHAPE14_SEED:-77}" --out "$wfile"
      wargs="--weights $wfile"
    fi
    python3 -m kkdeploy build --shape 14 --device "$DEVICE" --force $wargs ${SHAPE14_BUILD_ARGS:-} \
      --out "$WORK/s14-$w" || echo "shape14 build $w: exit $?"
    cp "$WORK/s14-$w/manifest.json" "$OUT/s14-$w-manifest.json" 2>/dev/null
    for r in ${SHAPE14_RUN_PADDING:-0 0.25}; do
      python3 -m kkdeploy run --artifacts "$WORK/s14-$w" --padding-ratio "$r" --json "$WORK/s14-$w-run-$r.json" \
        || echo "shape14 run $w padding $r: exit $?"
    done
    (cd "$WORK" && tar czf "$OUT/shape14-runs.tgz" s14-*-run-*.json s14-*/long-context-validation.json 2>/dev/null)
  done
}
step_layernorm() {
  # The rows LayerNorm kernel, every launch, on every official shape's LayerNorms: the build's proof step.
  python3 scripts/layer_norm_selftest.py --out "$OUT/layer-norm.json" --all-launches ${LAYERNORM_ARGS:-}
}
every_launch_unless_named() {  # ARGS: --all-launches, unless ARGS name the launches to study (--launches)
  case " $1 " in *" --launches "*) ;; *) echo --all-launches ;; esac
}
step_linear() {
  # kkdeploy_faithful::linear's Triton GEMM tiles with their epilogues, every official shape: the build's proof step.
  # every launch, unless LINEAR_ARGS names some (--launches linear=auto,tma,tma_ws)
  set -- --out "$OUT/fused-linear.json" $(every_launch_unless_named "${LINEAR_ARGS:-}") ${LINEAR_ARGS:-}
  echo "+ scripts/fused_linear_selftest.py $*"
  python3 scripts/fused_linear_selftest.py "$@"
}
step_attention() {
  # The faithful attention kernel, every launch that fits the rows, every official shape: the build's proof step.
  set -- --out "$OUT/attention.json" $(every_launch_unless_named "${ATTENTION_ARGS:-}") ${ATTENTION_ARGS:-}
  echo "+ scripts/faithful_attention_selftest.py $*"
  python3 scripts/faithful_attention_selftest.py "$@"
}
step_shape14tiles() {
  # Issue 19: where a reference-order shape-14 tile spends its time, and which skips of masked work are bitwise.
  python3 scripts/shape14_tile_study.py --out "$OUT/shape14-tiles.json" ${SHAPE14TILES_ARGS:-}
}
step_setup() {
  # Carried wheels (.whl/*.whl), installed once per machine into /tmp/site without dependencies: polygraphy
  # (the validator needs it) and, when carried, ModelOpt AutoCast's set for the -autocast candidates.
  # The serving carry (scripts/serving_carry.sh) stages its wheels under .whl/serving/: its polygraphy serves too.
  [ -e /tmp/site/.kk-wheels ] && return 0
  local wheels
  wheels=$(ls .whl/*.whl 2>/dev/null)
  # the serving carry's polygraphy only where none is carried on its own (pip refuses the same wheel twice)
  case "$wheels" in *polygraphy-*) ;; *) wheels="$wheels $(ls .whl/serving/polygraphy-*.whl 2>/dev/null)" ;; esac
  [ -n "${wheels// /}" ] || { echo "setup: no wheels under .whl/ (carry [\".whl\"])" >&2; return 2; }
  python3 -m pip install -q --no-deps --no-index --target /tmp/site $wheels || { echo "setup: pip failed" >&2; return 2; }
  touch /tmp/site/.kk-wheels
  python3 -c "import polygraphy; print('polygraphy', polygraphy.__version__)"
  python3 -c "import modelopt.onnx.autocast, modelopt; print('modelopt', modelopt.__version__)" 2>/dev/null || true
}
step_buildtime() {
  # Issue 28's build-time target: `kkdeploy build` of BUILDTIME_SHAPES (default 6) with default backends and weights
  # of our own (scripts/make_weights.py --seed 600 + shape), cold caches unless the machine is warm; the stages and
  # each candidate's compile and proof seconds printed, the process's wall time (scripts/wall_phases.py: to its first
  # line, to the "build N s" line, to its exit), manifests into buildtime.tgz. BUILDTIME_ARGS: extra flags,
  # BUILDTIME_TAG: a suffix for the output folder (two builds of one shape in one call). BUILDTIME_PROFILE=1: the
  # build runs in-process under cProfile instead (its main thread: where the seconds go, function by function),
  # the 45 costliest by cumulative time printed, the stats in $OUT/bt-N.prof.
  for s in ${BUILDTIME_SHAPES:-6}; do
    python3 scripts/make_weights.py --shape "$s" --seed $((600 + s)) --out "$WORK/w$s.safetensors" > /dev/null
    set -- build --shape "$s" --device "$DEVICE" --force --weights "$WORK/w$s.safetensors" ${BUILDTIME_ARGS:-} \
      --out "$WORK/bt-$s${BUILDTIME_TAG:-}"
    if [ -n "${BUILDTIME_PROFILE:-}" ]; then
      python3 - "$OUT/bt-$s${BUILDTIME_TAG:-}.prof" "$@" <<'PY' || echo "buildtime shape $s: exit $?"
import cProfile, pstats, sys
from kkdeploy.cli import main
profile = cProfile.Profile()
rc = profile.runcall(main, sys.argv[2:])
profile.dump_stats(sys.argv[1])
pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
sys.exit(rc)
PY
    else
      python3 scripts/wall_phases.py --mark '^build [0-9]' -- python3 -m kkdeploy "$@" \
        || echo "buildtime shape $s: exit $?"
    fi
    python3 - "$WORK/bt-$s${BUILDTIME_TAG:-}/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print("BUILDTIME", m["config"], "build_seconds", m.get("build_seconds"), m.get("build_stages"))
for c in m["candidates"]:
    o = c.get("options") or {}
    print("  cand", c["name"], c["status"], "build_s", c.get("build_seconds"), "compile_s", o.get("compile_seconds"),
          "proof_s", o.get("proof_seconds"), o.get("proof_phases") or "")
    for r in o.get("kernel_proofs") or []:
        print("    proof", r.get("op"), r.get("shape"), "s", r.get("seconds"), "chosen", r.get("chosen"))
print("CHOICE", m["choice"])
PY
  done
  (cd "$WORK" && tar czf "$OUT/buildtime.tgz" --exclude='*.pt2' --exclude='*.safetensors' --exclude='*.inductor-cache' \
     --exclude='*.onnx' bt-*)
}
step_layers() {
  # Issue 31: whole blocks in one or two launches (kkdeploy.kernels.layer_kernels), op by op against the reference
  # and timed against eager and torch-graph in one process. LAYERS_SHAPES, LAYERS_ARGS (e.g. --weights own:4711).
  python3 scripts/layer_kernels_h200.py --shapes "${LAYERS_SHAPES:-2,3,4,7,12}" --json "$OUT/layers.json" \
    ${LAYERS_ARGS:-}
}
step_prove() {
  # The build's proof step on its own, per official shape (PROVE_SHAPES): each kernel op's launches proven here.
  for s in ${PROVE_SHAPES:-3 6 8 13}; do
    python3 -m kkdeploy prove --shape "$s" --device "$DEVICE" --json "$OUT/prove-$s.json" || echo "prove shape $s: exit $?"
  done
}
step_custom() {
  # Non-official shapes (CUSTOM_SHAPES: "SEED:B,S,D,H,F,L" each), trained-like weights of our own
  # (scripts/make_weights.py --seed SEED; each shape keeps the seed it has had since campaign 14, 4242 + its place in
  # that list): `kkdeploy build --backends torch-compile` (what ships, the proof's and the build's seconds), then
  # `kkdeploy bench --processes 1` of torch-compile and the our-kernel candidates, eager in the same process. The two
  # that sat below 1.5x plain torch-compile run first, so that a step cut short still measures them.
  for pair in ${CUSTOM_SHAPES:-4247:16,200,384,6,768,3 4245:1,1024,1024,16,1024,2 4242:8,256,256,8,512,2 4243:32,512,512,8,2048,2 4244:64,64,64,4,256,4 4246:256,128,128,1,384,2}; do
    seed=${pair%%:*}; spec=${pair#*:}
    IFS=, read -r b s d h f l <<< "$spec"
    dims="--batch-size $b --seq-len $s --d-model $d --heads $h --ffn-dim $f --layers $l"
    w="$WORK/custom/w-$spec.safetensors"; mkdir -p "$WORK/custom"
    python3 scripts/make_weights.py $dims --seed "$seed" --out "$w" > /dev/null
    start=$(date +%s.%N)
    python3 -m kkdeploy build $dims --device "$DEVICE" --weights "$w" --backends torch-compile --force ${CUSTOM_BUILD_ARGS:-} \
      --out "$WORK/custom/build-$spec" || echo "custom build $spec: exit $?"
    echo "custom build $spec: $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s wall"
    python3 -m kkdeploy bench $dims --device "$DEVICE" --weights "$w" --processes 1 --out "$WORK/custom/bench-$spec" \
      --candidates "${CUSTOM_CANDIDATES:-torch-compile,torch-compile-faithful-attention,torch-compile-faithful-kernels,torch-compile-faithful-gemms}" \
      ${CUSTOM_BENCH_ARGS:-} || echo "custom bench $spec: exit $?"
    (cd "$WORK" && tar czf "$OUT/custom.tgz" --exclude='*.safetensors' --exclude='*.inductor-cache' custom)
    python3 scripts/bench_summary.py "$WORK"/custom/bench-* --versus torch-compile --md "$OUT/custom.md" > /dev/null
  done
  cat "$OUT/custom.md"
}
step_bench() {
  # BENCH_DTYPE float16|float32, BENCH_CONTRACT strict|judge, BENCH_PROCESSES (3), BENCH_ARGS (extra flags).
  # Every bench.json carries each timed backend's roofline (fraction of the limit measured in its processes), and
  # the summary its column, geomean and the three shapes furthest from their limit (docs/benchmark.md, Roofline).
  # BENCH_WEIGHTS_SEED: weights of our own per shape (scripts/make_weights.py, seed BENCH_WEIGHTS_SEED + shape),
  # the held-out weights issue 31's figures ask for; unset, the seeded ones.
  dt=${BENCH_DTYPE:-float16}; ct=${BENCH_CONTRACT:-strict}
  for s in ${BENCH_SHAPES:-2 3 12 1 4 5 7 9 10 11 8 13 6}; do
    wargs=""
    if [ -n "${BENCH_WEIGHTS_SEED:-}" ]; then
      python3 scripts/make_weights.py --shape "$s" --seed $((BENCH_WEIGHTS_SEED + s)) --out "$WORK/wb$s.safetensors"
      wargs="--weights $WORK/wb$s.safetensors"
    fi
    python3 -m kkdeploy bench --shape "$s" --device "$DEVICE" --dtype "$dt" --contract "$ct" --processes "${BENCH_PROCESSES:-3}" \
      $wargs ${BENCH_ARGS:-} --out "$WORK/bench-$dt-$ct/shape-$s" || echo "bench shape $s: exit $?"
    # after every shape: a timeout keeps what finished
    (cd "$WORK" && tar czf "$OUT/bench-$dt-$ct.tgz" "bench-$dt-$ct")
    python3 scripts/bench_summary.py "$WORK/bench-$dt-$ct" --md "$OUT/summary-$dt-$ct.md" > /dev/null
  done
  cat "$OUT/summary-$dt-$ct.md"
}
step_profile() {
  # PROFILE_SHAPES (8 6 5 11), PROFILE_ARGS (extra flags, e.g. --candidate torch-compile-fused-mixed)
  for s in ${PROFILE_SHAPES:-8 6 5 11}; do
    python3 scripts/profile_candidate.py --shape "$s" --device "$DEVICE" ${PROFILE_ARGS:-} --out "$WORK/profile/shape-$s" \
      || echo "profile shape $s: exit $?"
    [ -d "$WORK/profile" ] && (cd "$WORK" && tar czf "$OUT/profile.tgz" profile)  # a timeout keeps what finished
  done
}

step_customprofile() {
  # Where the time goes on the custom shapes that sit below 1.5x plain torch-compile (CUSTOMPROFILE_SHAPES:
  # "SEED:B,S,D,H,F,L", the seeds the custom step gives them): the proof step's records (which launch runs, ATen's ms
  # beside it), then eager, torch-compile and the three our-kernel candidates profiled kernel by kernel in one process.
  mkdir -p "$OUT/customprofile"
  for pair in ${CUSTOMPROFILE_SHAPES:-4247:16,200,384,6,768,3 4245:1,1024,1024,16,1024,2}; do
    seed=${pair%%:*}; spec=${pair#*:}
    IFS=, read -r b s d h f l <<< "$spec"
    dims="--batch-size $b --seq-len $s --d-model $d --heads $h --ffn-dim $f --layers $l"
    w="$WORK/w-$spec.safetensors"; mkdir -p "$WORK"
    python3 scripts/make_weights.py $dims --seed "$seed" --out "$w" > /dev/null
    python3 -m kkdeploy prove $dims --device "$DEVICE" --weights "$w" --json "$OUT/customprofile/prove-$spec.json" \
      || echo "prove $spec: exit $?"
    python3 scripts/profile_candidate.py --dims "$spec" --weights "$w" --device "$DEVICE" --dtype float16 --contract strict \
      --candidate "${CUSTOMPROFILE_CANDIDATES:-torch-compile,torch-compile-faithful-attention,torch-compile-faithful-kernels,torch-compile-faithful-gemms}" \
      --calls 50 --warmups 20 --top 30 --out "$OUT/customprofile/prof-$spec" > "$OUT/customprofile/prof-$spec.txt" 2>&1 \
      || echo "profile $spec: exit $?"
    grep -E "ms per call|^  [a-z]" "$OUT/customprofile/prof-$spec.txt"
  done
}
step_pdl() {
  # Programmatic dependent launches (kkdeploy/kernels/dependent_launch.py): each graph plain and as its "-pdl" form in
  # one process, eager beside them, every candidate validated on every trial, weights of our own. Official shapes
  # PDL_SHAPES (seed 600+N), then custom ones PDL_DIMS ("SEED:B,S,D,H,F,L", e.g. the custom step's two below 1.5x:
  # "4247:16,200,384,6,768,3 4245:1,1024,1024,16,1024,2"); PDL_PROCESSES, PDL_CANDIDATES.
  mkdir -p "$WORK/pdl"
  candidates=${PDL_CANDIDATES:-torch-compile,torch-compile-pdl,torch-compile-faithful-attention,torch-compile-faithful-attention-pdl,torch-compile-faithful-gemms,torch-compile-faithful-gemms-pdl}
  pdl_bench() {  # NAME SEED SHAPE-FLAGS...: weights of our own, one bench, the table rewritten (a timeout keeps the rest)
    local name=$1 seed=$2; shift 2
    python3 scripts/make_weights.py "$@" --seed "$seed" --out "$WORK/w-pdl-$name.safetensors" > /dev/null
    python3 -m kkdeploy bench "$@" --device "$DEVICE" --dtype float16 --contract strict --processes "${PDL_PROCESSES:-1}" \
      --weights "$WORK/w-pdl-$name.safetensors" --out "$WORK/pdl/$name" --candidates "$candidates" \
      || echo "pdl $name: exit $?"
    (cd "$WORK" && tar czf "$OUT/pdl.tgz" pdl)
    python3 scripts/bench_summary.py "$WORK/pdl" --pdl --versus torch-compile --md "$OUT/pdl.md" > /dev/null
  }
  for s in ${PDL_SHAPES-3 2 12 4 7}; do
    pdl_bench "shape-$s" $((600 + s)) --shape "$s"
  done
  for pair in ${PDL_DIMS:-}; do
    IFS=, read -r b s d h f l <<< "${pair#*:}"
    pdl_bench "custom-${pair#*:}" "${pair%%:*}" --batch-size "$b" --seq-len "$s" --d-model "$d" --heads "$h" \
      --ffn-dim "$f" --layers "$l"
  done
  cat "$OUT/pdl.md"
}
step_ncu() {
  # Each kernel of a candidate's call under Nsight Compute (scripts/ncu_profile.py): time share, DRAM and SM
  # throughput against their peaks, occupancy, registers; the largest terms of shapes NCU_SHAPES (weights of our own,
  # seed 600+N) and custom NCU_DIMS ("SEED:B,S,D,H,F,L"). NCU_CANDIDATE (torch-compile-faithful-gemms), NCU_ARGS.
  mkdir -p "$WORK/ncu"
  ncu_one() {  # NAME SEED "WEIGHT-FLAGS" PROFILE-FLAGS...: make_weights takes the shape as flags, the profile as --dims
    local name=$1 seed=$2 wflags=$3; shift 3
    python3 scripts/make_weights.py $wflags --seed "$seed" --out "$WORK/w-ncu-$name.safetensors" > /dev/null
    python3 scripts/ncu_profile.py "$@" --weights "$WORK/w-ncu-$name.safetensors" --device "$DEVICE" \
      --candidate "${NCU_CANDIDATE:-torch-compile-faithful-gemms}" ${NCU_ARGS:-} --out "$WORK/ncu/$name" \
      > "$WORK/ncu/$name.log" 2>&1 || echo "ncu $name: exit $?"
    tail -n 40 "$WORK/ncu/$name.log"
    (cd "$WORK" && tar czf "$OUT/ncu.tgz" ncu)
  }
  for s in ${NCU_SHAPES-6 13 8 3}; do
    ncu_one "shape-$s" $((600 + s)) "--shape $s" --shape "$s"
  done
  for pair in ${NCU_DIMS:-}; do
    IFS=, read -r b s d h f l <<< "${pair#*:}"
    ncu_one "custom-${pair#*:}" "${pair%%:*}" "--batch-size $b --seq-len $s --d-model $d --heads $h --ffn-dim $f --layers $l" \
      --dims "${pair#*:}"
  done
}
step_customops() {
  # Issue 20 Part B: the CUDA kernels of the kkdeploy custom ops against ATen, op by op, every official shape
  # (needs nvcc and ONNX Runtime's C API headers: carry them and set KKDEPLOY_ORT_INCLUDE). --ort when
  # onnxruntime-gpu is installed: one-node CUDA EP sessions of each op on shape 3's activations.
  python3 scripts/custom_ops_gpu_selftest.py --out "$OUT/custom-ops.json" ${CUSTOMOPS_ARGS:-}
}
step_ortstrict() {
  # Issue 20 Part B end to end: FP16 strict builds whose graph uses the kkdeploy ops for every Linear, LayerNorm
  # and GELU (ORTSTRICT_SHAPES, ORTSTRICT_BACKENDS), then one table; the torch-compile rows are the yardstick.
  for s in ${ORTSTRICT_SHAPES:-3 2 12}; do
    python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --dtype float16 --force --linear custom --layer-norm custom \
      --gelu custom --backends "${ORTSTRICT_BACKENDS:-ort-cuda,torch-compile}" --out "$WORK/strict-$s" \
      || echo "ortstrict shape $s: exit $?"
    python3 scripts/build_table.py "$WORK"/strict-* --md "$OUT/ortstrict.md" --json "$OUT/ortstrict.json" > /dev/null
  done
  cat "$OUT/ortstrict.md"
}
step_gather() {
  # Issue 30: a shape-3 build (GATHER_SHAPE) with --batch-buckets 1,2,4 and weights of our own (seed 700 + shape), as
  # the serving runs ship it, then scripts/serving_gather_study.py on it: the in-process backend's execute on host
  # buffers as Triton hands them over, its gather split into pieces (among them x copied from pageable memory and
  # through pinned memory), every route's answer checked bit for bit.
  s=${GATHER_SHAPE:-3}
  python3 scripts/make_weights.py --shape "$s" --seed $((700 + s)) --out "$WORK/wg$s.safetensors" > /dev/null
  python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --weights "$WORK/wg$s.safetensors" --force \
    --backends "${GATHER_BACKENDS:-torch-compile-faithful-gemms}" --batch-buckets 1,2,4 --out "$WORK/gather-$s" \
    | tail -4 || echo "gather build shape $s: exit $?"
  python3 scripts/serving_gather_study.py --artifacts "$WORK/gather-$s" --device "$DEVICE" --json "$OUT/gather.json"
}
step_cli() {
  # A new user's session with the real CLI on the GPU, no script in between: shape CLI_SHAPE (default 3) built with
  # the default flags twice, with weights of our own (--weights, scripts/make_weights.py seed 800 + shape) and with
  # the seeded ones; each artifact run all-valid and padded, and inspected; one served (below); then two mistakes a
  # user makes (weights that do not exist, a directory that holds no artifacts), each of which must be a one-line
  # error.
  s=${CLI_SHAPE:-3}
  python3 scripts/make_weights.py --shape "$s" --seed $((800 + s)) --out "$WORK/wc$s.safetensors" > /dev/null
  for w in own seeded; do
    weights=(); [ "$w" = own ] && weights=(--weights "$WORK/wc$s.safetensors")
    echo "--- kkdeploy build --shape $s --device $DEVICE ${weights[*]} --out cli-$s-$w"
    python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --force "${weights[@]}" --out "$WORK/cli-$s-$w" \
      2>&1 | tail -22 || echo "cli build $w: exit $?"
    for pad in 0 0.5; do
      echo "--- kkdeploy run --artifacts cli-$s-$w --padding-ratio $pad --seed 91"
      python3 -m kkdeploy run --artifacts "$WORK/cli-$s-$w" --padding-ratio "$pad" --seed 91 2>&1 | tail -8 \
        || echo "cli run $w $pad: exit $?"
    done
    python3 -m kkdeploy inspect "$WORK/cli-$s-$w" 2>&1 | head -7
  done
  # Then serving it as a user would: `kkdeploy serve` on the artifact with weights of our own (one bucket, the
  # artifact's batch), the default engine (on a GPU: the in-process backend where it builds) and then the Python
  # backend, a load test from another shell, and Ctrl-C.
  # On the GPU this needs the serving carry (.whl/serving, scripts/serving_carry.sh); the CPU has its own server.
  if [ "$DEVICE" = cpu ] || { [ -f .whl/serving/SHA256SUMS ] && . scripts/serving_setup.sh; }; then
    for engine in auto python; do
      echo "--- kkdeploy serve --artifacts cli-$s-own --engine $engine; kkdeploy loadtest; Ctrl-C"
      python3 -m kkdeploy serve --artifacts "$WORK/cli-$s-own" --engine "$engine" > "$WORK/cli-serve.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 600); do
        grep -q "^ready in" "$WORK/cli-serve.log" && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.5
      done
      grep -E "^repository|^ready in|in-process on|^error" "$WORK/cli-serve.log" | cut -c1-300
      python3 -m kkdeploy loadtest --artifacts "$WORK/cli-$s-own" --protocol grpc --processes 2 --concurrency 4 \
        --requests 1500 --mix 1:0.7,4:0.3 --padding 0,0.25 2>&1 | tail -14 || echo "cli loadtest $engine: exit $?"
      kill -INT "$pid" 2>/dev/null; wait "$pid"; echo "serve exit $?"
      tail -2 "$WORK/cli-serve.log"
    done
  else
    echo "--- kkdeploy serve: skipped (no serving carry under .whl/serving: carry [\".whl\"])"
  fi
  echo "--- mistakes"
  python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --weights "$WORK/no-such.safetensors" --out "$WORK/cli-x" \
    2>&1 | tail -3; echo "exit ${PIPESTATUS[0]}"
  python3 -m kkdeploy run --artifacts "$WORK" 2>&1 | tail -3; echo "exit ${PIPESTATUS[0]}"
}
step_ab() {
  # A code change against the tree as committed (scripts/ab_bench.py: one bench process a side, base, edit, base again,
  # the plan held by a shared proof cache), with each call's timeline the bench records (span, busy time, the gaps
  # between kernels: kkdeploy/pipeline/timeline.py). AB_EDITS: edit scripts under scripts/ab_edits, one A/B
  # each (default: the LayerNorm prologue, then the masked final LayerNorm); AB_SHAPES (3), AB_WEIGHTS_SEED (721:
  # make_weights seed 721 + shape), AB_ARGS (more ab_bench flags: --profile adds each side's kernel profile and Chrome
  # traces, one more compile a side), AB_BENCH_ARGS (its --bench-args, one string: the bench's own options). The
  # tables land in campaign.log, everything but the trees, caches and weights in ab.tgz (a timeout keeps what
  # finished).
  mkdir -p "$WORK/ab"
  for edit in ${AB_EDITS:-norm_prologue_joins_builds.sh masked_final_joins_builds.sh}; do
    [ -f "scripts/ab_edits/$edit" ] || { echo "ab: no edit scripts/ab_edits/$edit"; continue; }
    python3 scripts/ab_bench.py --shapes "${AB_SHAPES:-3}" --weights-seed "${AB_WEIGHTS_SEED:-721}" --device "$DEVICE" \
      ${AB_ARGS:-} --bench-args "${AB_BENCH_ARGS:-}" --edit "bash $PWD/scripts/ab_edits/$edit" \
      --out "$WORK/ab/${edit%.sh}" \
      | tail -25 || echo "ab $edit: exit $?"
    (cd "$WORK" && tar czf "$OUT/ab.tgz" --exclude='tree-edit' --exclude='cache-*' --exclude='*.safetensors' ab)
  done
}
step_ortjudge() {
  # Issue 20 Part A: float32 builds under the judge contract (TF32 on, as judged) with every ORT candidate next
  # to the fused torch candidate, shape by shape (ORTJUDGE_SHAPES, ORTJUDGE_BACKENDS); the table is rewritten
  # after every shape, so a timeout keeps what finished.
  for s in ${ORTJUDGE_SHAPES:-3 2 12 1 4 7 9 10 5 11 8 13 6}; do
    python3 -m kkdeploy build --shape "$s" --device "$DEVICE" --dtype float32 --contract judge --force \
      --backends "${ORTJUDGE_BACKENDS:-ort-cuda,torch-compile-fused-half-gemm-mixed}" --out "$WORK/judge-$s" \
      || echo "ortjudge shape $s: exit $?"
    python3 scripts/build_table.py "$WORK"/judge-* --md "$OUT/ortjudge.md" --json "$OUT/ortjudge.json" > /dev/null
  done
  cat "$OUT/ortjudge.md"
}

for arg in "$@"; do
  name=${arg%%=*}; limit=${arg#*=}; [ "$limit" = "$arg" ] && limit=540
  echo "=== step $name (limit ${limit}s) $(date -u +%T)" | tee -a "$log"
  start=$(date +%s)
  # The step's shell stops at the INT too (trap), so a loop over shapes does not start the next one.
  ( export -f "step_$name" every_launch_unless_named; timeout --signal=INT --kill-after=15 "$limit" bash -c "trap 'exit 130' INT; step_$name" ) 2>&1 | tee -a "$log"
  echo "=== step $name done: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start ))s" | tee -a "$log"
done
