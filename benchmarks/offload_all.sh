#!/usr/bin/env bash
# Issue 4's figures: `memfit bench` with the disk store (memory-mapped files in $OFFLOAD_DIR, default
# runs/offload-store) for ResNet-50 and VGG-16 at their CPU default sizes (memfit.zoo.default_size):
# none, chen, vdnn-all, vdnn-conv, remat-ilp and memfit (recompute + offload + variants jointly) at
# activation budgets 70%..20%. One thread, OMP_WAIT_POLICY=PASSIVE. Writes runs/offload_<model>/
# {results.json,results.csv,pareto.png} and runs/offload_<model>.log. About 15 minutes per model on 2 cores;
# run it on a quiet machine (the copy thread needs the second core). Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
PYTHON=${PYTHON:-python}
store=${OFFLOAD_DIR:-runs/offload-store}
mkdir -p runs
filter() { grep -v -E "USDT|gpuGetDeviceCount" || true; }
for m in resnet50 vgg16; do
  read -r batch size < <($PYTHON -c "from memfit import zoo; print(*zoo.default_size('$m'))")
  $PYTHON -m memfit.cli bench --model "$m" --batch "$batch" --image-size "$size" \
      --budgets 70%,50%,40%,33%,25%,20% --strategies none,chen,vdnn-all,vdnn-conv,remat-ilp,memfit \
      --offload-dir "$store" --steps 5 --threads 1 --out "runs/offload_$m" 2>&1 | filter | tee "runs/offload_$m.log"
done
