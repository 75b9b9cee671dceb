#!/usr/bin/env bash
# One call on the lent GPU machine (Python 3.12 + its own torch, no internet): install the package
# with the CUDA extension, run every CUDA test, then the synthetic benchmarks, results under $OUT.
#   scripts/device_run.sh [bench args...]   (wheels for packages missing there travel in .whl/)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS
CUDAARCHS=${CUDAARCHS:-90} python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5
echo "== install + CUDA build: $((SECONDS - start)) s"
python3 -c "import ninfer_core.ops.dispatch as d; print('== kernels available:', d.kernels_available())"
python3 -m pytest -m cuda -q -rs -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
for spec in "tiny-qwen3.6-moe 512 64" "qwen3.6-35b-a3b 4096 32" "qwen3.6-27b 4096 16"; do
  set -- $spec
  python3 -m ninfer_app bench --synthetic "$1" --device cuda --prompt-tokens "$2" --decode-tokens "$3" --json \
    > "$OUT/bench_$1.json" 2> "$OUT/bench_$1.err"
  echo "== bench $1: $(cat "$OUT/bench_$1.json") $(tail -2 "$OUT/bench_$1.err")"
done
