#!/usr/bin/env bash
# A peer engine and snugkv on one model shape in one device call, loaded by the same client
# (`snugkv bench peers`, docs/bench/peers.md). One call = one peer + one shape.
#   device run:  bash scripts/peers_check.sh vllm llama-3-8b [offline,stress]
#   PEER: vllm | sglang | none (snugkv alone); SHAPE: llama-3-8b qwen3-0.6b qwen3-30b-a3b llama-3-8b-fp8
#   carry: .peer/PEER, .peer/models/DIR (the shape's; the FP8 shape's is llama-3-8b), .peer/serve.sh,
#          .peer/setup.sh, .whl (scripts/fetch_device_wheels.sh: snugkv's server wheels)
#   more flags: PEERS_ARGS="--prompts ids --stress-prompts ids,text" (to `snugkv bench peers`)
#   DEADLINE_S (default 570): seconds into the call by which everything has stopped
# Results: $OUT/peers-PEER-SHAPE.json and .md, every log in $OUT/logs.tar.gz (packed after the run
# and on any exit). Name the commit: SNUGKV_COMMIT=$(git rev-parse --short HEAD) (a copied tree's
# git metadata can be stale).
set -uo pipefail
peer=${1:?usage: peers_check.sh vllm|sglang|none SHAPE [CASES]}
shape=${2:?usage: peers_check.sh vllm|sglang|none SHAPE [CASES]}
cases=${3:-offline,stress}
DEADLINE_S=${DEADLINE_S:-570}
FINAL=${OUT:-$PWD/gpu-out}
WORK=/tmp/peers-work  # the device returns at most 8 files from $OUT: the logs travel packed
PEER_SITE=/tmp/peer-site
rm -rf "$WORK" && mkdir -p "$WORK" "$FINAL"
finish() {
  cp "$WORK"/peers-*.json "$WORK"/peers-*.md "$FINAL"/ 2>/dev/null
  tar -czf "$FINAL/logs.tar.gz" -C "$WORK" . 2>/dev/null
}
trap finish EXIT
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
echo "=== env ($(date +%T))"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$WORK/env.txt"
echo "cpus: $(nproc) online, cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)" | tee -a "$WORK/env.txt"

# snugkv's own server wheels; its PYTHONPATH never reaches the peer (bench peers gives the peer its site alone)
SNUGKV_PATH="$PWD/src"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/snugkv-site \
    .whl/*.whl && SNUGKV_PATH="$SNUGKV_PATH:/tmp/snugkv-site"
else
  echo "warning: no .whl: snugkv serve needs fastapi and uvicorn (bash scripts/fetch_device_wheels.sh, carry .whl)"
fi
export PYTHONPATH="$SNUGKV_PATH"

site_args=()
if [ "$peer" != none ]; then
  echo "=== unpack $peer ($(date +%T))"
  if ! timeout 180 bash .peer/setup.sh "$peer" ".peer/$peer" "$PEER_SITE" 2>&1 | tee "$WORK/setup.log"; then
    echo "error: the $peer pack did not unpack (carry .peer/$peer and .peer/setup.sh); snugkv runs alone"
    peer=none
  else
    site_args=(--peer-site "$PEER_SITE")
  fi
fi

left=$((DEADLINE_S - SECONDS))
echo "=== bench peers $peer $shape $cases, ${left} s left ($(date +%T))"
# bench peers stops its servers on SIGTERM; the KILL 20 s later only if it hangs
timeout -k 20 "$((left + 10))" python3 -m snugkv bench peers --peer "$peer" --shape "$shape" --cases "$cases" \
  "${site_args[@]}" --serve-sh .peer/serve.sh --models-dir .peer/models --deadline-s "$left" \
  --out "$WORK" ${PEERS_ARGS:-} 2>&1 | tee "$WORK/bench_peers.log"
status=${PIPESTATUS[0]}
echo "=== done status=$status ($(date +%T))"
exit "$status"
