#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, then run the named steps,
# logging each under $OUT. Usage: bash tools/device_run.sh "pytest -m gpu tests/x.py" ...
set -u
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export FLASHINFER_JIT_CACHE_DIR=${FLASHINFER_JIT_CACHE_DIR:-/tmp/fij-cache}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
i=0
for step in "$@"; do
  i=$((i + 1))
  echo "=== step $i: $step"
  start=$(date +%s)
  bash -c "$step" > "${OUT:-/tmp}/${OUT_PREFIX:-}step$i.log" 2>&1
  rc=$?
  echo "=== step $i rc=$rc $(( $(date +%s) - start ))s"
  tail -n 40 "${OUT:-/tmp}/${OUT_PREFIX:-}step$i.log"
done
