#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the GPU tests (NCCL at world size 1, gloo ranks sharing
# the GPU, inductor, fp8's fused casts bit for bit) and one-GPU step times of the precision recipes
# (bf16 / bf16-autocast, fp8 / bf16 with the casts fused and eager, torchao float8 where installed), on
# the default GPT and on one whose matrix products are large enough for float8 to pay.
#   OUT=/some/dir bash benchmarks/device_check.sh      (each part's output lands in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cube-device-check}
mkdir -p "$OUT"
run() {   # name, command...: the command's output in $OUT/name.txt, its last lines here
    local name=$1; shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.txt" 2>&1
    echo "   exit $?"; tail -n 6 "$OUT/$name.txt"
}
run nvidia-smi nvidia-smi
run test_gpu python -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs
run recipes python -m benchmarks.gpu --recipes --fp8
LARGE=(--layers 4 --dim 4096 --heads 32 --seq 2048 --batch 4 --steps 5 --rounds 3)
run recipes_large python -m benchmarks.gpu --recipes --fp8 "${LARGE[@]}"
CUBE_FP8_FUSED=0 run recipes_large_eager_casts python -m benchmarks.gpu --recipes --fp8 "${LARGE[@]}"
