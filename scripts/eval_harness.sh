#!/usr/bin/env bash
# lm-evaluation-harness against a real `snugkv serve` (OpenAI completions backend, `local-completions`)
# and against lm-eval's own transformers backend (`hf`) on the same weights: the embedded SmolLM2,
# dequantized once into a float32 Hugging Face directory that both load. Runs three local tasks
# (tests/eval: multiple choice log-likelihood, rolling perplexity, greedy generation) and fails
# unless every score agrees (scripts/compare_eval_scores.py).
#
#   LM_EVAL=/path/to/venv/bin/lm_eval scripts/eval_harness.sh [OUT_DIR]
#
# LM_EVAL: lm_eval in an environment of its own (its torch and transformers pins are its own);
# PYTHON: the python that runs snugkv (default: this repository's .venv, or python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-$ROOT/eval-out}
LM_EVAL=${LM_EVAL:-lm_eval}
PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
PORT=${PORT:-18431}
TASKS=snugkv_tiny_mc,snugkv_tiny_ppl,snugkv_tiny_gen
MODEL_DIR=$OUT/smollm2-hf
export PYTHONPATH=$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PYTHON" -c "import sys; from tests.models.test_smollm2 import save_hf_directory; save_hf_directory(sys.argv[1])" "$MODEL_DIR"
fi

"$PYTHON" -m snugkv serve --model "$MODEL_DIR" --device cpu --dtype float32 --port "$PORT" \
  --served-model-name smollm2 > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done

"$LM_EVAL" --model local-completions --include_path tests/eval --tasks "$TASKS" \
  --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=2048" \
  --output_path "$OUT/snugkv" --log_samples
"$LM_EVAL" --model hf --include_path tests/eval --tasks "$TASKS" \
  --model_args "pretrained=$MODEL_DIR,dtype=float32,max_length=2048" --device cpu --batch_size 1 \
  --output_path "$OUT/hf" --log_samples
"$PYTHON" scripts/compare_eval_scores.py "$OUT/snugkv" "$OUT/hf"
