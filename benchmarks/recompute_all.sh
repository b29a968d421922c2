#!/usr/bin/env bash
# Issues 2 and 3's CPU benchmark: every zoo model at its CPU default size (about a second a step; ResNet-50
# at batch 16, 128x128 as in issue 2), one thread; strategies chen, checkpoint-all, remat-ilp (recompute
# only) and memfit (recompute + operator variants). Writes runs/recompute_<model>.{json,log}.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
run() {
  local m=$1; shift
  OMP_WAIT_POLICY=PASSIVE "${PYTHON:-python}" benchmarks/recompute_sweep.py --model "$m" "$@" \
      --strategies chen,checkpoint-all,remat-ilp,memfit --steps 4 \
      --out "runs/recompute_$m.json" 2>&1 | grep -v -E "USDT|gpuGetDeviceCount" > "runs/recompute_$m.log"
}
run resnet50 --batch 16 --image-size 128 --fractions 0.5,0.4,0.33
for m in mobilenet_v2 googlenet unet vgg16; do run "$m" --fractions 0.5,0.33; done
