#!/usr/bin/env bash
# An A/B of two trees in one GPU call: COMMAND runs in BASE (a tree of another commit) and in
# this one, alternating ROUNDS times, each side with its own kernel cache, so both are timed
# on the same GPU in the same minutes (two calls on two machines differ by more than most
# changes do: docs/perf-log, MQA round 28). Logs: $OUT/ab_base<i>.log and $OUT/ab_this<i>.log.
#
#   here:   mkdir -p .device/base && git archive REV flashinfer_jit jit_kernels templates tools \
#               pyproject.toml | tar -x -C .device/base      # carry .device
#   there:  bash tools/device_ab.sh .device/base 2 "python3 tools/bench_qsa.py --short --points ..."
#
# COMMAND runs with the tree's root as its working directory and on its PYTHONPATH (a
# relative path in it names a file of that tree: name this tree's with $AB_HERE, e.g.
# --deepgemm \$AB_HERE/.peer); a --json FILE in it is the caller's to keep apart (give it
# $SIDE: "base" or "this").
set -u
base=$1 rounds=$2 command=$3
out=${OUT:-/tmp}
here=$PWD
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for i in $(seq 1 "$rounds"); do
  for side in base this; do
    root=$here
    [ "$side" = base ] && root=$(cd "$base" && pwd)
    start=$(date +%s)
    (cd "$root" && AB_HERE=$here SIDE=$side FLASHINFER_JIT_CACHE_DIR=/tmp/fij-ab-$side PYTHONPATH=/tmp/site:$root \
      bash -c "$command") > "$out/ab_$side$i.log" 2>&1
    echo "=== $side round $i rc=$? $(( $(date +%s) - start ))s"
    tail -n 25 "$out/ab_$side$i.log"
  done
done
