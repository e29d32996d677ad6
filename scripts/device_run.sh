#!/usr/bin/env bash
# One GPU session's checks in one command: the Triton example compiled (scripts/triton_gpu_check.sh)
# and the built-in CUDA targets on the default grid and their features (scripts/gpu-check),
# their outputs packed into OUT/results.tgz.  Exit status: the worse of the two.
#     scripts/device_run.sh OUT [TRITON_SECONDS] [GPU_CHECK_SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: scripts/device_run.sh OUT [TRITON_SECONDS] [GPU_CHECK_SECONDS]" >&2
    exit 2
fi
OUT=$1; TRITON_S=${2:-330}; GPU_S=${3:-210}
RES=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LIMIT=$((TRITON_S / 3)) PYTHON=python3 timeout "$TRITON_S" bash scripts/triton_gpu_check.sh "$RES/triton"
triton_rc=$?
echo "triton_gpu_check exit $triton_rc"
timeout $((GPU_S + 20)) python3 scripts/gpu-check --out "$RES/gpu" --budget "$GPU_S" --steps info,targets,check,features
gpu_rc=$?
echo "gpu-check exit $gpu_rc"
mkdir -p "$OUT" && tar czf "$OUT/results.tgz" -C "$RES" . && rm -rf "$RES"
exit $(( triton_rc > gpu_rc ? triton_rc : gpu_rc ))
