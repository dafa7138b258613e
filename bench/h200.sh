#!/usr/bin/env bash
# Runs on the GPU machine (the `device` tool), from the repository root:
#   bash bench/h200.sh smoke|kit|bench|all       (smoke: tile freedom + quick kit + negative control)
# Installs this checkout (and the carried stevedore wheel in .whl/) into /tmp/site, then runs
# from outside the checkout so that the installed package (with hal.backends.cuda) is imported.
# Results go to $OUT (JSON + logs); commit them under bench/results/ with this command.
set -uo pipefail
mode=${1:-all}
repo=$(pwd)
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
python3 -m hal.cli doctor | tee "$out/doctor.txt"
status=0
if [[ $mode == smoke || $mode == all ]]; then
  python3 "$repo/bench/tile_freedom.py" --json "$out/tile_freedom.json" 2>&1 | tee "$out/tile_freedom.log" || status=1
  python3 -m hal.cli conformance --backend cuda --quick --max-examples ${KIT_EXAMPLES:-4} --json "$out/conformance_cuda_quick.json" \
    > "$out/conformance_cuda_quick.log" 2>&1 || status=1
  grep -E '^\||CONFORM|passed|failed|Error' "$out/conformance_cuda_quick.log" | tail -n 30
fi
if [[ $mode == kit || $mode == all ]]; then
  python3 -m hal.cli conformance --backend cuda --full --json "$out/conformance_cuda.json" > "$out/conformance_cuda.log" 2>&1 || status=1
  tail -n 40 "$out/conformance_cuda.log"
fi
if [[ $mode != bench ]]; then  # the negative control: stock kernels on the GPU must fail levels 2-3
  python3 -m hal.cli conformance --backend torch --max-examples ${KIT_EXAMPLES:-4} --json "$out/conformance_torch.json" \
    > "$out/conformance_torch.log" 2>&1
  grep '^|' "$out/conformance_torch.log"
fi
if [[ $mode == bench || $mode == all ]]; then
  python3 "$repo/bench/bench_cuda.py" ${BENCH_ARGS:-} --json "$out/bench_cuda.json" 2>&1 | tee "$out/bench_cuda.log" || status=1
fi
exit $status
