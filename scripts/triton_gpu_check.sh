#!/usr/bin/env bash
# examples/triton_attention.py compiled for the GPU, held to the reference by check, and
# its copy with the accumulator's rescale dropped (which must fail, named).
#
#     scripts/triton_gpu_check.sh [OUT_DIR]        # default OUT_DIR: out/triton-gpu-run
#
# Needs a CUDA device, PyTorch with CUDA and triton (pip install -e ".[triton]").
# Writes OUT_DIR/versions.txt, and per run NAME.txt (check's table), NAME.json and
# NAME.rc: correct (float16, bfloat16), correct-float32 (tl.dot in IEEE float32) and bug.
# Exit status 0 when the kernel passes both correct runs and the bug copy fails with
# acc-not-rescaled; 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/triton-gpu-run}
PY=${PYTHON:-python}
LIMIT=${LIMIT:-600}                 # seconds per run
mkdir -p "$OUT"
unset TRITON_INTERPRET              # compiled kernels, not the interpreter

"$PY" - > "$OUT/versions.txt" 2>&1 <<'PYEOF'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PYEOF
cat "$OUT/versions.txt"

GRID=(--device cuda --tokens 128,1024 --head-dim 64,128 --causal both)
run() {   # run NAME TARGET OPTIONS...
    local name=$1 target=$2; shift 2
    local start=$SECONDS
    timeout "$LIMIT" "$PY" -m parity_tests check "$target" "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$rc" > "$OUT/$name.rc"
    echo "$name: exit $rc in $((SECONDS - start)) s: $(tail -n 1 "$OUT/$name.txt")"
}
run correct examples.triton_attention:attention "${GRID[@]}" --dtype float16,bfloat16
run correct-float32 examples.triton_attention:attention "${GRID[@]}" --dtype float32
run bug examples.triton_attention_bug:attention "${GRID[@]}" --dtype float16,bfloat16

named=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["summary"]["diagnosis"])' \
        "$OUT/bug.json" 2>/dev/null || echo "no JSON")
echo "bug diagnosed as: $named"
if [ "$(cat "$OUT/correct.rc")" = 0 ] && [ "$(cat "$OUT/correct-float32.rc")" = 0 ] \
   && [ "$(cat "$OUT/bug.rc")" = 1 ] && [ "$named" = acc-not-rescaled ]; then
    echo "triton gpu check: ok"; exit 0
fi
echo "triton gpu check: NOT ok (see $OUT)"; exit 1
