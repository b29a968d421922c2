#!/usr/bin/env bash
# Issue 4's figures: `memfit bench` with the disk store (memory-mapped files in $OFFLOAD_DIR, default
# runs/offload-store): none, chen, vdnn-all, vdnn-conv, remat-ilp and memfit (recompute + offload + variants
# jointly) for ResNet-50 (batch 8, 128 px: its CPU default size) at activation budgets 70%..20%, and VGG-16
# at batch 8, 128 px (at its default batch of 2 the classifier's 400 MiB weight-gradient temporary is 90% of
# the "activation" peak and nothing else can be saved) at 95%..70%. One thread, OMP_WAIT_POLICY=PASSIVE.
# Writes runs/offload_<model>/{results.json,results.csv,pareto.png} and runs/offload_<model>.log; then
# `python benchmarks/offload_table.py runs/offload_*/results.json` prints the tables of BENCHMARKS.md.
# About 15 (ResNet-50) and 40 (VGG-16) minutes on 2 cores; run it on a quiet machine (the copy thread
# needs the second core). Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
PYTHON=${PYTHON:-python}
store=${OFFLOAD_DIR:-runs/offload-store}
mkdir -p runs
filter() { grep -v -E "USDT|gpuGetDeviceCount" || true; }
run() {  # model batch size budgets
  $PYTHON -m memfit.cli bench --model "$1" --batch "$2" --image-size "$3" --budgets "$4" \
      --strategies none,chen,vdnn-all,vdnn-conv,remat-ilp,memfit --offload-dir "$store" --steps 5 --threads 1 \
      --out "runs/offload_$1" 2>&1 | filter | tee "runs/offload_$1.log"
}
for m in ${MODELS:-resnet50 vgg16}; do
  case $m in
    resnet50) run resnet50 8 128 70%,50%,40%,33%,25%,20% ;;
    vgg16) run vgg16 8 128 95%,90%,85%,80%,75%,70% ;;
  esac
done
