#!/usr/bin/env bash
# One lent GPU's checks, in one call (docs/gpu.md): the CUDA tests, then the time part of
# benchmarks/gpu.py. Output under $OUT (default benchmarks/results/gpu/check).
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-benchmarks/results/gpu/check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FXSHARD_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
# The 32-layer 70 GiB plan runs on fake tensors (the CPU's cores), beside the rest.
timeout 420 python3 -m pytest -q -n 0 -m "" -p no:cacheprovider tests/test_cuda.py -k fits_70 \
    > "$OUT/test_cuda_70gib.log" 2>&1 &
plan=$!
timeout 150 python3 -m pytest -q -n 0 -m "" -p no:cacheprovider tests/test_cuda.py -k "not fits_70" \
    2>&1 | tail -25 | tee "$OUT/test_cuda.log"
timeout "${TIME_PART_S:-330}" python3 benchmarks/gpu.py --parts time --timeout 100 --out "$OUT" \
    --time-worlds "${TIME_WORLDS:-nccl1,fake8,rehearse8:h100-nvlink,fake16,rehearse16:h100-ib}" \
    2>&1 | tee "$OUT/time.log" | grep -v '^{' | tail -30
wait $plan; echo "70 GiB plan: exit $?"; tail -5 "$OUT/test_cuda_70gib.log"
