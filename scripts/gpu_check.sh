#!/usr/bin/env bash
# Builds the CUDA extension ninfer_core._C in place (a direct CMake build, no pip, no network)
# and runs the CUDA tests. Needs a CUDA GPU, nvcc, CMake >= 3.24, torch, pybind11 and pytest.
#
#   scripts/gpu_check.sh                      # pytest -m cuda over tests/
#   scripts/gpu_check.sh tests/test_ops.py    # extra pytest arguments narrow the run
#
# Environment: PYTHON (default python3), CUDA_ARCHS (default: CMakeLists.txt's list, e.g. "90"
# to build for the H200 only), BUILD_DIR (default build/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

PY=$(command -v "${PYTHON:-python3}")
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
BUILD_DIR=${BUILD_DIR:-build/gpu-check}

echo "== python: $("$PY" --version) ($PY)"
"$PY" - <<'PYEOF'
import torch
print(f"== torch {torch.__version__}, built for CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    raise SystemExit("== no CUDA device visible to torch: nothing to check")
props = torch.cuda.get_device_properties(0)
print(f"== GPU: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB")
PYEOF
echo "== nvcc: $("$NVCC" --version | grep -i release)"
echo "== cmake: $(cmake --version | head -1)"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
arch_flag=()
[[ -n "${CUDA_ARCHS:-}" ]] && arch_flag=("-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS}")

start=$SECONDS
NINFER_CUDA=ON cmake -S . -B "$BUILD_DIR" "${generator[@]}" "${arch_flag[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)"
cmake --build "$BUILD_DIR" --parallel
rm -f ninfer_core/_C.*.so ninfer_core/_C.so
cmake --install "$BUILD_DIR" --prefix "$PWD"
echo "== built in $((SECONDS - start)) s: $(ls ninfer_core/_C*.so)"

"$PY" -c "import ninfer_core._C as m; print('== extension loads:', m.__file__)"
"$PY" -m pytest -m cuda -q -rs --continue-on-collection-errors -p no:cacheprovider "$@"
