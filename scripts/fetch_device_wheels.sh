#!/usr/bin/env bash
# Wheels the device lacks (it has no network): the server stack and gguf, for CPython 3.12.
# Run here, then carry .whl to the device; scripts/gpu_check.sh installs them into /tmp/site.
#   bash scripts/fetch_device_wheels.sh && (device run with carry [".whl"]) bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi uvicorn httpx gguf
# The device's own numpy, tqdm and requests stay: a copy on PYTHONPATH would shadow them.
rm -f .whl/numpy-* .whl/tqdm-* .whl/requests-* .whl/urllib3-* .whl/charset_normalizer-*
ls .whl && du -sh .whl
