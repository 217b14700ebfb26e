#!/bin/bash
# The checks a lent GPU machine runs, in one call (docs/performance/index.md, "GPUs").
#   bash bench/gpu_checks.sh [STEP...]  # the steps below (default all: 1-5); OUT=folder for the logs
# Wheels of what that machine lacks (pyzmq, pytest-asyncio) may wait in .whl/.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, zmq; print('torch', torch.__version__, 'cuda devices', torch.cuda.device_count(), 'pyzmq', zmq.__version__)"
PY="python3 -m pytest -p no:cacheprovider -q -rs"
STEPS=" ${*:-1 2 3 4 5} "
step() { [[ "$STEPS" == *" $1 "* ]] && echo "== $1. $2"; }

step 1 "the CUDA tests" && timeout 180 $PY -n 0 -m "" tests/test_overlap.py tests/test_torch_bulk.py tests/test_hop_processes.py \
    -k "cuda or gpu or loop" 2>&1 | tee "$OUT/cuda_tests.txt" | tail -12

if [ -f .gpu_old/overlap.py ] && step 2 "the on-loop test against the hooks before the fix (expected to hang: killed after 45 s)"; then
    mkdir -p /tmp/old && cp -r hopnet /tmp/old/ && cp .gpu_old/overlap.py /tmp/old/hopnet/protocols/overlap.py
    (cd /tmp/old && cp -r "$OLDPWD/tests" . && cp "$OLDPWD/pyproject.toml" . && \
        PYTHONPATH=/tmp/site:/tmp/old timeout 45 python3 -m pytest -p no:cacheprovider -q -n 0 \
        tests/test_overlap.py -k "loop and cuda" > "$OUT/old_hooks.txt" 2>&1; echo "exit $?"; tail -3 "$OUT/old_hooks.txt")
fi

if step 3 "two ranks of a CUDA model on one GPU, --bulk torch"; then
    timeout 90 python3 -m hopnet.cli.main launch --nproc 2 --bulk torch --no-progress --timeout 30 --run-dir /tmp/two \
        tests/workers/hop_worker.py --iterations 20 --compute-ms 1 --device cuda > "$OUT/two_ranks_one_gpu.txt" 2>&1
    echo "exit $?"
    grep -i "nccl\|duplicate\|error\|both on" "$OUT/two_ranks_one_gpu.txt" | grep -v "destroy_process_group\|unbatched P2P" | cut -c1-400 | head -12
fi

step 4 "the fast tier with CUDA visible" && timeout 200 $PY -n 12 -m "not slow" 2>&1 | tee "$OUT/not_slow.txt" | tail -15

# NCCL against DDP needs a GPU per rank (NCCL refuses two ranks on one device); both run orders.
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if step 5 "allreduce against DDP over NCCL, a GPU per rank ($GPUS GPUs)"; then
    if [ "$GPUS" -lt 2 ]; then
        echo "skipped: $GPUS GPU(s); NCCL needs one per rank"
    else
        N=$(( GPUS < 4 ? GPUS : 4 ))
        for order in ddp,allreduce allreduce,ddp; do
            timeout 150 python3 bench/ddp.py --workload wide --device cuda --nproc "$N" --batch-size 256 \
                --iterations 100 --warmup 20 --eval-every 50 --runs "$order" --out /tmp/gpu_ddp 2>&1 \
                | tee -a "$OUT/nccl_ddp.txt" | grep "^| \(ddp\|allreduce\) "
        done
    fi
fi
exit 0  # (a step left out is not a failure)
