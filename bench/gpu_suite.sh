#!/usr/bin/env bash
# What a GPU session runs on the lent machine (the device tool), with its raw output under $OUT (or ./gpu_out).
#   bash bench/gpu_suite.sh bench [ARGS...]   bench/gpu_transition.py (default: both models, steady + goodput + plain
#                                             rebuild pauses), output in $OUT/bench.log and $OUT/gpu_transition.md
#   bash bench/gpu_suite.sh tests             tests/gpu (NCCL grow, shrink, SIGKILL recovery, communicator shrink)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
what=${1:-bench}
shift || true
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git rev-parse HEAD 2>/dev/null; } \
    | tee -a "$OUT/env.txt"
# the GPUs' clocks, temperature, power and throttle reasons every 2 s while it runs (they drift as the GPUs heat)
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active \
        --format=csv -l 2 >"$OUT/gpu_clocks_$what.csv" 2>/dev/null &
    smi=$!
    trap 'kill $smi 2>/dev/null' EXIT
fi
case $what in
    bench)
        args=("$@")
        ((${#args[@]})) || args=(--models resnet50,gpt2 --mode all --paths plain)
        python3 bench/gpu_transition.py "${args[@]}" --out "$OUT/gpu_transition.md" 2>&1 \
            | grep -v 'socket.cpp\|TCPStore.cpp' | tee "$OUT/bench.log" ;;
    tests)
        python3 -m pytest -m gpu -q -s tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" ;;
    *) echo "usage: $0 bench [ARGS...] | tests" >&2; exit 2 ;;
esac
