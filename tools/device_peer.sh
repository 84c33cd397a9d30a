#!/usr/bin/env bash
# On the GPU machine: build DeepGEMM (the indexer's peer) from a source folder unless its
# extension is already there, in the background while the steps before `--` run; then
# the steps after `--`. Usage: bash tools/device_peer.sh DG_DIR STEP... -- STEP...
# Each step's log (tools/device_run.sh) and the built extension (to carry next time) land
# in $OUT. DG_DIR holds DeepGEMM's source with third-party/cutlass/include and
# third-party/fmt (tools/peer_tree.sh assembles it from git mirrors; FACTS.md says how it
# builds there).
set -u
dg=$1
shift
out=${OUT:-/tmp}
export CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
cp -rn "$dg"/third-party/cutlass/include/cute "$dg"/third-party/cutlass/include/cutlass "$dg"/deep_gemm/include/
builder=
if ! ls "$dg"/deep_gemm/_C*.so >/dev/null 2>&1; then
  (cd "$dg" && DG_FORCE_BUILD=1 python3 setup.py build_ext --inplace >"$out/dg_build.log" 2>&1 &&
    cp deep_gemm/_C*.so "$out/") &
  builder=$!
fi
before=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do before+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#before[@]} -gt 0 ] && bash tools/device_run.sh "${before[@]}"
if [ -n "$builder" ]; then
  wait "$builder"
  echo "DeepGEMM build rc=$? after the steps above"
  tail -3 "$out/dg_build.log"
fi
# DeepGEMM's std::regex crashes through a libstdc++ mix on that image (FACTS.md).
[ $# -gt 0 ] && LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 OUT_PREFIX=post bash tools/device_run.sh "$@"
