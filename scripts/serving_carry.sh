#!/usr/bin/env bash
# Stage what the lent H200 needs to serve (issues 30 and 33) into the git-ignored folder .whl/serving/, small enough
# to travel in ONE device call with the working tree (64 MiB in all):
#   tritonserver.tar.xz  the server of nvidia-pytriton 0.7.0 (installed here by `kkdeploy serve --install-server`,
#                        i.e. pip --require-hashes on the wheel's published sha256), only the Python 3.12 stub kept:
#                        ~35 MB instead of the 55 MB wheel (the wheel plus the clients would not fit)
#   *.whl                tritonclient[grpc] 2.73.0 for cp312 and what it needs that the H200 lacks (grpcio, protobuf,
#                        python-rapidjson, urllib3; hpack for `loadtest --client native`; xxhash, its answer check):
#                        ~10 MB; polygraphy 0.53.6 (the builds' validator: the H200 has none)
#   optional/*.whl       cuda-bindings 13.0.3 and cuda-pathfinder (tritonclient's CUDA shared memory, `loadtest
#                        --shared-memory cuda`): ~12 MB, installed on the device only where the GPU's Python lacks them
#   SHA256SUMS           checked on the device before anything is installed
# Then: device call with carry [".whl"], command `bash scripts/serving_h200.sh` (see docs/serving.md, "The H200").
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.whl/' .gitignore || { echo ".whl/ must be git-ignored" >&2; exit 2; }
out=.whl/serving
rm -rf "$out" && mkdir -p "$out"
python3 -m kkdeploy serve --install-server > /dev/null
cache=$(python3 -c "from kkdeploy.serving.triton_server import _managed_root; print(_managed_root().parent.parent)")
keep=3.12
excludes=()
for stub in "$cache"/pytriton/tritonserver/python_backend_stubs/*; do
  [ "$(basename "$stub")" = "$keep" ] || excludes+=(--exclude="pytriton/tritonserver/python_backend_stubs/$(basename "$stub")")
done
tar -C "$cache" -cJf "$out/tritonserver.tar.xz" "${excludes[@]}" pytriton/tritonserver nvidia_pytriton.libs
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$out" tritonclient==2.73.0 grpcio==1.85.3 protobuf==6.33.6 python-rapidjson==1.25 urllib3==2.8.0 hpack==4.2.0 \
  xxhash==4.1.0 polygraphy==0.53.6
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$out/optional" cuda-bindings==13.0.3 cuda-pathfinder==1.9.1
(cd "$out" && sha256sum tritonserver.tar.xz ./*.whl ./optional/*.whl > SHA256SUMS)
tree=$(git ls-files -z | xargs -0 cat | wc -c)
staged=$(du -cb "$out" | tail -1 | cut -f1)
echo "staged $out: $((staged / 1048576)) MiB + working tree $((tree / 1048576)) MiB (limit 64 MiB)"
[ $((staged + tree)) -lt $((64 * 1048576)) ] || { echo "too large to carry in one call" >&2; exit 1; }
