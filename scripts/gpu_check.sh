#!/usr/bin/env bash
# kdist on a GPU machine, one call, results under $OUT: the environment; then,
# for each backend the machine has, `kdist-bench` (kdist against Keras fit,
# paired epoch by epoch, float32 and mixed_bfloat16) at global batches 64 and
# 1,024 on one GPU, that backend's plain peer at the same batches (JAX: optax,
# scripts/jax_optax_loop.py; torch: DDP, scripts/ddp_baseline.py; TensorFlow:
# the tutorial's loop), and a short `kdist-train` run, saved and restored.
#
#   OUT=gpu-results bash scripts/gpu_check.sh
#
# Wheels in .whl/ (keras and what the machine lacks) are installed first, to
# /tmp/site, without the network. GPU_CHECK_STEPS=N shortens every timed epoch
# to N steps (a dry run on a CPU machine).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)"
    python3 --version
    KERAS_BACKEND=jax python3 -c "import keras; print('keras', keras.__version__)"
} 2>&1 | tee "$OUT/env.txt"

declare -A peer=([jax]=jax_optax_loop.py [torch]=ddp_baseline.py [tensorflow]=tf_tutorial_loop.py)
for backend in jax torch tensorflow; do
    export KERAS_BACKEND=$backend
    if ! python3 -c "import $backend, keras" 2>/dev/null; then
        echo "$backend: not installed on this machine" | tee -a "$OUT/env.txt"
        continue
    fi
    for batch in 64 1024; do
        # 25,600 and 51,200 examples an epoch (--synthetic has 60,000).
        steps=${GPU_CHECK_STEPS:-$((batch == 64 ? 400 : 50))}
        echo "== $backend, global batch $batch, $steps steps an epoch"
        timeout 110 python3 scripts/bench.py --synthetic --no-peak --replicas 1 \
            --batch-size-per-replica "$batch" --steps "$steps" --windows 3 \
            --precision float32,mixed_bfloat16
        timeout 45 python3 "scripts/${peer[$backend]}" --replicas 1 \
            --batch-size-per-replica "$batch" --steps "$steps" --windows 3
    done 2>&1 | tee "$OUT/bench-$backend.txt"
    {
        echo "== $backend, kdist-train, then the same command restored"
        for _ in 1 2; do
            timeout 50 python3 scripts/train.py --synthetic 12000 --epochs 2 \
                --checkpoint-dir "/tmp/kdist-gpu-$backend"
        done
    } 2>&1 | tee "$OUT/train-$backend.txt"
done
grep -h '^{' "$OUT"/bench-*.txt > "$OUT/results.jsonl"
