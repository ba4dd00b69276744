#!/usr/bin/env bash
# kdist on a GPU machine: the environment, `bench.py` (kdist against Keras fit)
# at two batch sizes and every precision bench.py takes, and a short train.py
# run, for each backend the machine has. One call, results under $OUT.
#
#   OUT=gpu-results bash scripts/gpu_check.sh
#
# Wheels in .whl/ (keras and what the machine lacks) are installed first, to
# /tmp/site, without the network.
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
    KERAS_BACKEND=jax python3 -c "import jax, keras; print('jax', jax.__version__, jax.devices(), 'keras', keras.__version__)"
} 2>&1 | tee "$OUT/env.txt"

precisions=float32
if python3 scripts/bench.py --help 2>/dev/null | grep -q -- "--precision"; then
    precisions=float32,mixed_bfloat16,mixed_float16
fi
for backend in jax tensorflow; do
    if ! KERAS_BACKEND=$backend python3 -c "import keras" 2>/dev/null \
        || ! python3 -c "import $backend" 2>/dev/null; then
        echo "$backend: not installed on this machine" | tee -a "$OUT/env.txt"
        continue
    fi
    for batch in 64 1024; do
        args=(--synthetic --batch-size-per-replica "$batch" --steps 100 --windows 3)
        if [ "$precisions" != float32 ]; then args+=(--precision "$precisions"); fi
        KERAS_BACKEND=$backend timeout 240 python3 scripts/bench.py "${args[@]}" 2>&1 \
            | tee "$OUT/bench-$backend-$batch.txt"
    done
    KERAS_BACKEND=$backend timeout 180 python3 scripts/train.py --synthetic --epochs 2 \
        --steps-per-epoch 300 --checkpoint-dir "/tmp/kdist-gpu-$backend" --quiet 2>&1 \
        | tee "$OUT/train-$backend.txt"
done
