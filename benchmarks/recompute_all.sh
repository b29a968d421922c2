#!/usr/bin/env bash
# Issue 2's benchmark: every zoo model at its CPU default size (about a second a step), one thread.
# Writes runs/recompute_<model>.{json,log}. Takes about an hour on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
for m in resnet50 vgg16 mobilenet_v2 googlenet unet resnet18; do
  extra=""
  [ "$m" = resnet50 ] && extra="--batch 16 --image-size 128"
  OMP_WAIT_POLICY=PASSIVE python benchmarks/recompute_sweep.py --model "$m" $extra \
      --out "runs/recompute_$m.json" 2>&1 | grep -v -E "USDT|gpuGetDeviceCount" | tee "runs/recompute_$m.log"
done
