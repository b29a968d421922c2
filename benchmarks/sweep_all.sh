#!/usr/bin/env bash
# Issue 5's figures: `memfit bench` (every strategy at activation budgets 100%..25%, PyTorch's own
# activation_memory_budget, Rockmate if it can run) for each zoo model at its CPU default size
# (memfit.zoo.default_size), then `memfit max-batch` on ResNet-50 at 128 px within plain PyTorch's
# measured peak at batch 8. One thread, OMP_WAIT_POLICY=PASSIVE. Writes runs/bench_<model>/
# {results.json,results.csv,pareto.png}, runs/bench_<model>.log, runs/maxbatch_resnet50.{json,log}.
# Takes hours on a 2-core machine (each torch-budget row compiles the model once); not run in CI.
#
# Usage: benchmarks/sweep_all.sh              (aot_eager_decomp_partition only)
#        INDUCTOR=1 benchmarks/sweep_all.sh   (also torch.compile's inductor backend: minutes per row)
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
for m in resnet50 vgg16 mobilenet_v2 googlenet unet; do
  read -r batch size < <(python -c "from memfit import zoo; print(*zoo.default_size('$m'))")
  memfit bench --model "$m" --batch "$batch" --image-size "$size" --budgets "$budgets" \
      --strategies "$strategies" --torch-budgets 1.0,0.5,0.3,0.1,0.0 --steps 5 --threads 1 \
      "${extra[@]}" --out "runs/bench_$m" 2>&1 | filter | tee "runs/bench_$m.log"
done

# the largest batch each strategy trains within plain PyTorch's measured total peak at batch 8
memfit max-batch --model resnet50 --image-size 128 --budget-from-batch 8 \
    --strategies chen,checkpoint-all,remat-ilp,memfit,torch-budget --threads 1 "${extra[@]}" \
    --json runs/maxbatch_resnet50.json 2>&1 | filter | tee runs/maxbatch_resnet50.log
