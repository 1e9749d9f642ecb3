#!/usr/bin/env bash
# One lent GPU's checks, in one call (docs/gpu.md). Output under $OUT (default
# benchmarks/results/gpu/check).
#   OUT=/tmp/out bash benchmarks/gpu_check.sh            # the CUDA tests, then the time part
#   OUT=/tmp/out bash benchmarks/gpu_check.sh auto       # auto() under the rehearsals, and one nccl rank
#   OUT=/tmp/out bash benchmarks/gpu_check.sh plan70     # the 70 GiB CUDA plan: the attention kernels,
#                                                        # the candidates tried, the test
#   OUT=/tmp/out bash benchmarks/gpu_check.sh cputime    # benchmarks/time.py on the machine's CPUs:
#                                                        # two gloo ranks on cores of their own
set -u
OUT=${OUT:-benchmarks/results/gpu/check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FXSHARD_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
if [ "${1:-}" = auto ]; then
    # memory_budget: FSDP2's peak measured under each rehearsal (benchmarks/results/gpu/time.md).
    timeout 330 python3 benchmarks/gpu.py --parts time --timeout 150 --out "$OUT/auto" \
        --time-worlds rehearse8:h100-nvlink,rehearse16:h100-ib --systems fxshard,fsdp2,fxshard_auto \
        --budgets "rehearse8:h100-nvlink=${BUDGET8:-9.60},rehearse16:h100-ib=${BUDGET16:-8.25}" \
        2>&1 | tee "$OUT/auto.log" | grep -v '^{' | tail -40
    timeout 60 python3 benchmarks/gpu.py --parts time --timeout 55 --out "$OUT/nccl1" --time-worlds nccl1 \
        --systems fxshard 2>&1 | grep -v '^{' | tail -4
    exit 0
fi
if [ "${1:-}" = cputime ]; then
    # The time model's two-rank prediction on a host whose cores outnumber the ranks' threads:
    # on a 2-core machine, one call in ten of a small gloo collective waits a scheduler tick
    # (docs/time.md, "Where the model is known to err"). No GPU is used.
    timeout "${CPUTIME_S:-540}" python3 benchmarks/time.py --world-sizes 2 --runs "${RUNS:-3}" \
        --out "$OUT/cputime" 2>&1 | grep -v Warn | tail -20
    exit 0
fi
if [ "${1:-}" = plan70 ]; then
    # Which attention the CUDA plan traces here (flash on a machine without CUDA, cuDNN's with
    # torch 2.11 on an H200), and each kernel's plan; then the plan with every candidate the
    # budget tries, beside the test itself (each on a core of its own: explain plans on the CPU).
    timeout 120 python3 benchmarks/attention_probe.py --kernels 2>&1 | grep -v Warn | tee "$OUT/plan70_attention.txt"
    timeout "${PLAN_S:-420}" python3 benchmarks/attention_probe.py --plan70 > "$OUT/plan70_tried.txt" 2>&1 &
    timeout "${PLAN_S:-420}" python3 -m pytest -q -n 0 -m "" -p no:cacheprovider tests/test_cuda.py -k fits_70 \
        --durations=0 > "$OUT/test_cuda_70gib.log" 2>&1
    echo "70 GiB plan: exit $?"; tail -3 "$OUT/test_cuda_70gib.log"
    wait; grep -v Warn "$OUT/plan70_tried.txt" | head -5
    exit 0
fi
# The 32-layer 70 GiB plan runs on fake tensors (the CPU's cores), beside the rest.
timeout 420 python3 -m pytest -q -n 0 -m "" -p no:cacheprovider tests/test_cuda.py -k fits_70 \
    > "$OUT/test_cuda_70gib.log" 2>&1 &
plan=$!
timeout 150 python3 -m pytest -q -n 0 -m "" -p no:cacheprovider tests/test_cuda.py -k "not fits_70" \
    2>&1 | tail -25 | tee "$OUT/test_cuda.log"
timeout "${TIME_PART_S:-330}" python3 benchmarks/gpu.py --parts time --timeout 100 --out "$OUT" \
    --time-worlds "${TIME_WORLDS:-nccl1,fake8,rehearse8:h100-nvlink,fake16,rehearse16:h100-ib}" \
    --systems fxshard,fsdp2 2>&1 | tee "$OUT/time.log" | grep -v '^{' | tail -30
wait $plan; echo "70 GiB plan: exit $?"; tail -5 "$OUT/test_cuda_70gib.log"
