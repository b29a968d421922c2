#!/usr/bin/env bash
# Issue 5's figures: `memfit bench` (every strategy at activation budgets 100%..25%, PyTorch's own
# activation_memory_budget, Rockmate if it can run) for each zoo model at its CPU default size
# (memfit.zoo.default_size), then `memfit max-batch` on ResNet-50 at 128 px within plain PyTorch's
# measured peak at batch 8. One thread, OMP_WAIT_POLICY=PASSIVE. Writes runs/bench_<model>/
# {results.json,results.csv,pareto.png}, runs/bench_<model>.log, runs/maxbatch_resnet50.{json,log}.
# Takes hours on a 2-core machine (each torch-budget row compiles the model once); not run in CI.
#
# With OFFLOAD_DIR set, a second pass per model measures vdnn-all, vdnn-conv and memfit with the disk store
# there (memfit then plans recomputation, offloading and variants jointly): runs/bench_<model>_offload/.
#
# Usage: benchmarks/sweep_all.sh              (aot_eager_decomp_partition only)
#        INDUCTOR=1 benchmarks/sweep_all.sh   (also torch.compile's inductor backend: minutes per row)
#        MODELS="vgg16 unet" OFFLOAD_DIR=runs/offload-store MAXBATCH=0 benchmarks/sweep_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
mkdir -p runs
extra=()
[ "${INDUCTOR:-0}" = 1 ] && extra+=(--inductor)
strategies=none,chen,checkpoint-all,remat-ilp,memfit,torch-budget,rockmate
budgets=100%,70%,50%,40%,33%,25%
filter() { grep -v -E "USDT|gpuGetDeviceCount" || true; }

# sizes from memfit.zoo.default_size: resnet50 8x128, vgg16 2x128, mobilenet_v2 32x128, googlenet 16x128, unet 2x96
PYTHON=${PYTHON:-python}
for m in ${MODELS:-resnet50 vgg16 mobilenet_v2 googlenet unet}; do
  read -r batch size < <($PYTHON -c "from memfit import zoo; print(*zoo.default_size('$m'))")
  b=$budgets
  [ "$m" = vgg16 ] && b=100%,90%,80%,70%,50%,33%  # its floor is the first block's backward (~75%)
  $PYTHON -m memfit.cli bench --model "$m" --batch "$batch" --image-size "$size" --budgets "$b" \
      --strategies "$strategies" --torch-budgets 1.0,0.5,0.3,0.1,0.0 --steps 5 --threads 1 \
      "${extra[@]}" --out "runs/bench_$m" 2>&1 | filter | tee "runs/bench_$m.log"
  if [ -n "${OFFLOAD_DIR:-}" ]; then
    $PYTHON -m memfit.cli bench --model "$m" --batch "$batch" --image-size "$size" --budgets 50%,33%,25% \
        --strategies none,vdnn-all,vdnn-conv,memfit --offload-dir "$OFFLOAD_DIR" --steps 5 --threads 1 \
        --out "runs/bench_${m}_offload" 2>&1 | filter | tee "runs/bench_${m}_offload.log"
  fi
done
[ "${MAXBATCH:-1}" = 0 ] && exit 0

# the largest batch each strategy trains within plain PyTorch's measured total peak at batch 8
$PYTHON -m memfit.cli max-batch --model resnet50 --image-size 128 --budget-from-batch 8 \
    --strategies chen,checkpoint-all,remat-ilp,memfit,torch-budget --threads 1 "${extra[@]}" \
    --json runs/maxbatch_resnet50.json 2>&1 | filter | tee runs/maxbatch_resnet50.log
