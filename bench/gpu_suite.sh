#!/usr/bin/env bash
# What a GPU session runs on the lent machine (the device tool), with its raw output under $OUT (or ./gpu_out).
#   bash bench/gpu_suite.sh bench [ARGS...]   bench/gpu_transition.py (default: both models, steady + goodput + plain
#                                             rebuild pauses), output in $OUT/bench.log and $OUT/gpu_transition.md
#   bash bench/gpu_suite.sh ab [ARGS...]      bench/interleaved.py (interleaved A/B of the step), $OUT/ab.log
#   bash bench/gpu_suite.sh tests             tests/gpu (NCCL grow, shrink, SIGKILL recovery, communicator shrink)
#   bash bench/gpu_suite.sh vs-torchrun [ARGS...]  bench/vs_torchrun.py (default: every dataset, bf16 and fp32, 1 and 2
#                                             GPUs, 3 rounds), $OUT/vs_torchrun.log
#   bash bench/gpu_suite.sh loader-pauses     gpu_transition.py pauses of ResNet-50 with 8 loader workers at 4 ms an
#                                             item and with a fixed batch, $OUT/pause_loader.log, $OUT/pause_fixed.log
#   bash bench/gpu_suite.sh goodput-loader [ARGS...]  gpu_transition.py --mode steady with 8 DataLoader workers at
#                                             4 ms an item on both sides (goodput's measured ideal and ours),
#                                             ResNet-50, 300 steps a size (#23), $OUT/goodput_loader.{md,log}
#   bash bench/gpu_suite.sh jpeg-probe [ARGS...]  bench/jpeg_probe.py (where the GPU-decode JPEG row's time goes),
#                                             $OUT/jpeg_probe.log
#   bash bench/gpu_suite.sh calibrate [ARGS...]  the calibration job (python -m elastic_launcher.calibrate) at world
#                                             size 1, rows in $OUT/calibrate.jsonl, $OUT/calibrate.log
#   bash bench/gpu_suite.sh coldstart [--set=fresh|fresh2|fresh3|fresh4] [W...]  bench/coldstart_collect.py at each world size W
#                                             (default 1 2 4), W > 1 once per NCCL transport (nvlink, shm, socket);
#                                             $OUT/coldstart/*.jsonl; --set=fresh: the held-out models (issue 25);
#                                             TRANSPORTS="shm socket" limits W > 1 to those transports
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
            | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee "$OUT/bench.log" ;;
    coldstart)
        mkdir -p "$OUT/coldstart"
        set_args=()
        if [[ ${1:-} == --set=* ]]; then set_args=(--set "${1#--set=}"); shift; fi
        sizes=("$@")
        ((${#sizes[@]})) || sizes=(1 2 4)
        for w in "${sizes[@]}"; do
            read -r -a transports <<<"${TRANSPORTS:-nvlink shm socket}"
            ((w > 1)) || transports=(none)
            for tr in "${transports[@]}"; do
                env=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET "NCCL_DEBUG_FILE=$OUT/coldstart/nccl_w${w}_${tr}_%h_%p.log")
                case $tr in
                    shm) env+=(NCCL_P2P_DISABLE=1) ;;
                    socket) env+=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket) ;;
                esac
                echo "=== coldstart W=$w transport=$tr $(date -u +%T)"
                env "${env[@]}" timeout 420 python3 -m torch.distributed.run --standalone --nproc_per_node="$w" \
                    bench/coldstart_collect.py "${set_args[@]}" --transport "$tr" --out "$OUT/coldstart/w${w}_${tr}.jsonl" 2>&1 \
                    | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp\|^W[0-9]' | tee -a "$OUT/coldstart.log"
            done
        done ;;
    vs-torchrun)
        args=("$@")
        ((${#args[@]})) || args=(--data synthetic,jpeg,tokens --precision bf16,fp32 --gpus 1,2 --rounds 3)
        python3 bench/vs_torchrun.py "${args[@]}" 2>&1 | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee -a "$OUT/vs_torchrun.log" ;;
    loader-pauses)
        (cd bench && python3 gpu_transition.py --models resnet50 --paths ours --mode pauses --loader-workers 8 \
            --item-ms 4 --cycles 3 --out "$OUT/pause_loader.md" 2>&1 | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' \
            | tee "$OUT/pause_loader.log"
         python3 gpu_transition.py --models resnet50 --paths ours --mode pauses --cycles 3 \
            --out "$OUT/pause_fixed.md" 2>&1 | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee "$OUT/pause_fixed.log") ;;
    goodput-loader)
        args=("$@")
        ((${#args[@]})) || args=(--models resnet50 --mode steady --paths plain --loader-workers 8 --item-ms 4 --seg-steps 300)
        (cd bench && python3 gpu_transition.py "${args[@]}" --out "$OUT/goodput_loader.md" 2>&1 \
            | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee "$OUT/goodput_loader.log") ;;
    ab)
        python3 bench/interleaved.py "$@" 2>&1 | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee -a "$OUT/ab.log" ;;
    jpeg-probe)
        python3 bench/jpeg_probe.py "$@" 2>&1 | tee -a "$OUT/jpeg_probe.log" ;;
    calibrate)
        # the calibration job's probes at world size 1 (one GPU): rank 0 alone, no Slurm (its env set by hand)
        SLURM_PROCID=0 SLURM_NTASKS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29571} \
            python3 -m elastic_launcher.calibrate --device cuda --out "$OUT/calibrate.jsonl" "$@" 2>&1 \
            | grep --line-buffered -v 'socket.cpp\|TCPStore.cpp' | tee -a "$OUT/calibrate.log" ;;
    tests)
        python3 -m pytest -m gpu -q -s tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" ;;
    *) echo "usage: $0 bench [ARGS...] | ab [ARGS...] | vs-torchrun [ARGS...] | loader-pauses | goodput-loader [ARGS...] | jpeg-probe [ARGS...] | calibrate [ARGS...] | tests | coldstart [W...]" >&2
       exit 2 ;;
esac
