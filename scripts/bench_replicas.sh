#!/usr/bin/env bash
# `snugkv serve --dp 2 --kv-elastic` on one GPU: two replicas sharing its memory behind the smg
# router, measured through the router with `snugkv bench http --url` under cache_aware, then under
# round_robin (a fresh fleet each). Logs, each replica's KV size and load, and the tables go to $OUT.
#
# The device has no network: carry .whl with the server's wheels, smg's and a model directory
# whose tokenizer the server and the load generator share (random weights of a shipped shape):
#   python -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi uvicorn httpx gguf smg==1.13.0
#   (drop numpy, tqdm, requests, urllib3, charset_normalizer: the device has its own), then
#   MODEL=.whl/qwen3-0.6b-smoltok: the qwen3-0.6b config.json (vocab_size of the tokenizer) + SmolLM2's tokenizer files
#   device run (carry .whl): bash scripts/bench_replicas.sh   (BENCH_ARGS: more `bench http` flags)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
MODEL=${MODEL:-.whl/qwen3-0.6b-smoltok}
WORKLOADS=${WORKLOADS:-"offline,chat"}
status=0

serving_url() {  # the fleet's announcement (a replica's own "serving on" line starts with [replica N])
  grep -oP '^\S+ INFO snugkv\.server\.replicas: snugkv is serving on \K\S+' "$1" | head -1
}

for policy in cache_aware round_robin; do
  log="$OUT/fleet-$policy.log"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  echo "=== $policy ($(date +%T))"
  python3 -m snugkv serve --dp 2 --kv-elastic --model "$MODEL" --load-format dummy --port "$port" \
    --router-policy "$policy" >"$log" 2>&1 &
  fleet=$!
  for _ in $(seq 240); do
    [ -n "$(serving_url "$log")" ] && break
    kill -0 $fleet 2>/dev/null || break
    sleep 1
  done
  url=$(serving_url "$log")
  if [ -z "$url" ]; then
    echo "the fleet did not start"; tail -40 "$log"; status=1; kill $fleet 2>/dev/null; continue
  fi
  grep -E 'replicas: |KV sizing|Memory share' "$log" | grep -v '^\[router\]'
  python3 - "$log" >"$OUT/replicas-$policy.json" <<'PYEOF'
import json, re, sys, httpx
log = open(sys.argv[1]).read()
replicas = re.findall(r"^\S+ INFO snugkv\.server\.replicas: replica (\d+): pid \d+ on (\S+)", log, re.M)
print(json.dumps({index: {"loads": httpx.get(f"{url}/v1/loads").json()["loads"][0],
                          "kv": httpx.get(f"{url}/kv").json()} for index, url in replicas}, indent=1))
PYEOF
  work=$WORKLOADS
  [ "$policy" = round_robin ] && work=chat
  timeout 300 python3 -m snugkv bench http --url "$url" --tokenizer "$MODEL" --workloads "$work" \
    --out "$OUT/$policy" ${BENCH_ARGS:-} 2>&1 | tail -6 || status=1
  kill -TERM $fleet
  wait $fleet || { echo "the fleet exited with $?"; status=1; }
  grep -E 'replicas: (Stopped|SIGTERM)|exited with' "$log"
done
exit $status
