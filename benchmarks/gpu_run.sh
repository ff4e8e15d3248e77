#!/usr/bin/env bash
# One device call: install the wheels the GPU image lacks (carried in .whl/), then run the
# named stages, each as STAGE or STAGE:SECONDS (a time limit; 560 s by default).
# Usage (on the GPU machine, repo root):
#   bash benchmarks/gpu_run.sh tests:300 check:200 bench-a:560
# Results land in $OUT (the device tool's return folder); the log in $OUT/log.txt as it runs.
# Each stage is described in benchmarks/README.md; knobs are environment variables (KVC_*,
# SPEC_*, SO_*) with the defaults shown below.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
if [ -d .whl ] && ! [ -f /tmp/site/.done ]; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false PATH=/tmp/site/bin:$PATH
# the serving and structured-output benchmarks need a real tokenizer: SmolLM2's, in .bench_tok/
[ -d .bench_tok ] && export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/.bench_tok}
PYTEST="python -m pytest -q -x -p no:cacheprovider"

summary() {  # the headline numbers of every bench-a result in $1
  python - "$1" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*bench-a*.json"):
    d = json.load(open(f))
    for k, v in d.items():
        if k.startswith("pagedllm_"):
            keys = ("output_tokens_per_s", "roofline_fraction", "wall_ms_per_step",
                    "device_ms_per_step", "device_busy_fraction", "host_ms_per_decode_step",
                    "steps")
            print(k, {x: v.get(x) for x in keys})
    for k in ("peers", "ratio_vs_hf_continuous_batching", "ratio_vs_hf_static_generate"):
        print(k, d.get(k))
PY
}

kvc_d() {  # Benchmark D into $1 (extra arguments after it); KVC_BASELINE: one input length only
  local out=$1; shift
  python benchmarks/kvcompress_throughput.py --num-prompts "${KVC_PROMPTS:-256}" \
    --input-lens "${KVC_LENS:-6000}" --rates "${KVC_RATES:-64,8}" \
    ${KVC_BASELINE:+--baseline-json "$KVC_BASELINE"} ${KVC_TOKENS:+--max-num-batched-tokens \
    "$KVC_TOKENS"} ${KVC_PREFILL_ONLY:+--prefill-only} --out "$out" "$@" | grep -v "^ "
}

one() {
  case $1 in
    # tests on the GPU
    tests) $PYTEST tests/kernels tests/models tests/engine ;;
    tests-kernels) $PYTEST --durations=8 tests/kernels ;;
    tests-models) $PYTEST tests/models tests/engine ;;
    tests-hf) $PYTEST tests/models/test_hf_equality.py ;;
    tests-grammar) $PYTEST tests/kernels/test_bitmask.py tests/engine/test_grammars.py \
        tests/engine/test_structured_outputs.py ;;
    tests-kvc) $PYTEST tests/kernels/test_kvc_attention.py tests/kernels/test_kvc_step.py \
        tests/core/test_kvcompress.py tests/models/test_kvcompress.py ;;
    tests-kvc-par)  # the KV-Compress GPU tests in 7 processes (Triton compiles in parallel)
      K=tests/kernels/test_kvc_attention.py
      $PYTEST $K -k "test_decode and big-torch.bfloat16" > /tmp/t1 2>&1 &
      $PYTEST $K -k "test_decode and big-torch.float16" > /tmp/t2 2>&1 &
      $PYTEST $K -k "test_paged_mixed_batch and big-torch.bfloat16" > /tmp/t3 2>&1 &
      $PYTEST $K -k "test_paged_mixed_batch and big-torch.float16" > /tmp/t4 2>&1 &
      $PYTEST $K -k "not big" > /tmp/t5 2>&1 &
      $PYTEST tests/models/test_kvcompress.py > /tmp/t6 2>&1 &
      $PYTEST tests/core/test_kvcompress.py tests/kernels/test_kvc_step.py > /tmp/t7 2>&1 &
      wait; for f in /tmp/t[1-7]; do echo "--- $f"; tail -4 "$f"; done ;;
    tests-spec) $PYTEST --durations=5 tests/models/test_spec_decode.py \
        tests/spec_decode/test_ngram_gpu.py tests/kernels/test_spec_drafts.py ;;
    # greedy equality against HF, Benchmarks A and B, prefix caching and structured outputs
    check) python benchmarks/gpu_suite.py check --out "$OUT" ;;
    bench-a) python benchmarks/gpu_suite.py bench-a --sync-too --time-device --out "$OUT" \
        | grep -v "^ "; summary "$OUT" ;;
    bench-a-quick) python benchmarks/gpu_suite.py bench-a --skip-peers --time-device \
        --out "$OUT/quick" | grep -v "^ "; summary "$OUT/quick" ;;
    ab-a)  # Benchmark A (no peers) alternating a base tree in ab_base/ and this tree, twice.
      # Make the base first (git-ignored: pass carry ["ab_base"] to the device call):
      #   mkdir ab_base && git archive COMMIT pagedllm benchmarks pyproject.toml | tar -x -C ab_base
      for i in 1 2; do
        (cd ab_base && PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_suite.py bench-a \
          --skip-peers --time-device --out "$OUT/ab_base_$i" | grep -v "^ ")
        python benchmarks/gpu_suite.py bench-a --skip-peers --time-device --out "$OUT/ab_new_$i" \
          | grep -v "^ "
      done
      for d in "$OUT"/ab_*; do echo "$d"; summary "$d"; done ;;
    bench-b) python benchmarks/gpu_suite.py bench-b --out "$OUT" | tail -40 ;;
    bench-b-moe)  # Benchmark B on a mixture of experts (MOE_MODEL), HF's MoE on MOE_PEER_B prompts
      python benchmarks/gpu_suite.py bench-b --b-model "${MOE_MODEL:-qwen3-30b-a3b}" \
        --num-b "${MOE_NUM_B:-1000}" --peer-b "${MOE_PEER_B:-16}" --out "$OUT" | tail -40 ;;
    tests-moe) $PYTEST tests/kernels/test_fused_moe.py tests/models/test_moe.py ;;
    tune-moe)  # the fused MoE's block sizes for MOE_MODEL on this GPU (copy the table into
      # pagedllm/ops/fused_moe_configs.json to use it)
      python benchmarks/tune_fused_moe.py --model "${MOE_MODEL:-qwen3-30b-a3b}" \
        --out "$OUT/fused_moe_configs.json" ;;
    extras) python benchmarks/gpu_suite.py extras --out "$OUT" | tail -40 ;;
    structured) python benchmarks/gpu_suite.py extras --only-structured --out "$OUT" | tail -30 ;;
    # the per-kernel tables: a window of steps (KPROF_A / KPROF_B, START:COUNT) of Benchmark
    # A's workload and of Benchmark B's two, each kind of kernel against its bytes and FLOPs
    kprofile)
      T="python -m pagedllm.entrypoints.cli bench throughput --load-format dummy --dtype bfloat16
         --max-model-len 2048 --gpu-memory-utilization 0.85"
      $T --model qwen3-0.6b --num-prompts 256 --input-len 562 --output-len 562 \
        --range-ratio 0.822 --kernel-profile "${KPROF_A:-40:50}" \
        --output-json "$OUT/kernel_table_bench-a.json" | tail -2
      $T --model llama-3.1-8b --num-prompts 256 --input-len 128 --output-len 1024 \
        --kernel-profile "${KPROF_B:-200:50}" --output-json "$OUT/kernel_table_bench-b_in128_out1024.json" \
        | tail -2
      $T --model llama-3.1-8b --num-prompts "${KPROF_B_PROMPTS:-512}" --input-len 1024 \
        --output-len 128 --kernel-profile "${KPROF_B:-200:50}" \
        --output-json "$OUT/kernel_table_bench-b_in1024_out128.json" | tail -2
      python benchmarks/kernel_table.py "$OUT"/kernel_table_bench-*.json ;;
    # the server against the in-process engine (SERVING_MODES, SERVING_CONC; SERVING_PROFILE:
    # py-spy seconds on each server process at the last cap, where py-spy is in .whl/)
    serving-qwen) python benchmarks/serving_gpu.py --shape qwen3-0.6b --out "$OUT" \
        --modes "${SERVING_MODES:-offline,server_process,server_thread,canned}" \
        --concurrency "${SERVING_CONC:-1,64,256}" --profile-front "${SERVING_PROFILE:-0}" ;;
    serving-llama8b) python benchmarks/serving_gpu.py --shape llama-3.1-8b --single-prompts 8 \
        --out "$OUT" ;;
    # KV-Compress: Benchmark D (KVC_PROMPTS, KVC_LENS, KVC_RATES, KVC_BASELINE: an earlier
    # call's result file whose uncompressed run the rates are compared with), its variants,
    # and the cost of KV-Compress without a budget
    kvc-d) kvc_d "$OUT" ;;
    kv-offload)  # the host KV tier on a multi-turn chat replay: off / on / everything fits
      python benchmarks/kv_offload.py --model "${OFFLOAD_MODEL:-qwen3-0.6b}" --load-format dummy \
        --device cuda --conversations "${OFFLOAD_CONVS:-64}" --turns "${OFFLOAD_TURNS:-8}" \
        --out "$OUT" ;;
    tests-pd)  # the block-rows kernel, then the transfers' and the host tier's GPU paths
      $PYTEST tests/kernels/test_block_rows.py && $PYTEST tests/engine/test_kv_transfer.py \
        tests/engine/test_kv_transfer_buffer.py tests/engine/test_offload.py -k "gpu or plain_rows" ;;
    tests-kv-moves)  # the host tier's and the transfers' GPU paths, KV-Compress's rows too
      $PYTEST tests/engine/test_offload.py tests/engine/test_kv_transfer.py -k "gpu or plain_rows" ;;
    tests-fp8)  # fp8 KV caches: the kernels, then the engine (HF equality suite untouched)
      $PYTEST tests/kernels/test_fp8_kv.py tests/models/test_fp8_kv.py ;;
    tests-fp8-kvc)  # fp8 caches under KV-Compress: the per-head kernels, then the engine
      $PYTEST tests/kernels/test_fp8_kv.py && $PYTEST tests/kernels/test_kvc_attention.py -k fp8 \
        && $PYTEST tests/models/test_fp8_kv.py -k kv_compress ;;
    tests-lora)  # the LoRA shrink/expand Triton kernels against the PyTorch reference
      $PYTEST tests/kernels/test_lora_kernels.py ;;
    lora-a)  # Benchmark A's workload: the base model, then 4 and 16 rank-16 adapters mixed
      python benchmarks/lora_gpu.py --adapters "${LORA_ADAPTERS:-4,16}" --out "$OUT" ;;
    lora-micro)  # the shrink/expand kernels alone, launch parameters swept (LORA_TOKENS, LORA_SLOTS)
      python benchmarks/lora_micro.py --tokens "${LORA_TOKENS:-256,64}" \
        --slots "${LORA_SLOTS:-4,16}" --out "$OUT" | tail -12 ;;
    tools-required)  # free decoding vs tool_choice required's grammar (needs xgrammar in .whl/);
      # TOOLS_DIAGNOSE=1: also the host's time per call and the device's per step
      python benchmarks/tools_gpu.py --num-prompts "${TOOLS_PROMPTS:-256}" \
        ${TOOLS_DIAGNOSE:+--diagnose} --out "$OUT" ;;
    dashboard-a)  # Benchmark A offline, with vs without dashboard snapshots at 4 Hz (3 pairs)
      python benchmarks/dashboard_cost.py --gpu --pairs "${DASH_PAIRS:-3}" --out "$OUT" ;;
    tests-dcp)  # decode context parallelism's Triton kernels against the PyTorch reference
      $PYTEST tests/kernels/test_dcp_attention.py ;;
    dcp-2gpu)  # 2+ GPUs: the longest context and TPOT at DCP 1 vs 2 (8B shape, DCP_* knobs)
      python benchmarks/dcp_gpu.py --tp "${DCP_TP:-2}" --dcp "${DCP_SIZES:-1,2}" \
        --kv-heads "${DCP_KV_HEADS:-1}" --kv-gib "${DCP_KV_GIB:-1}" --out "$OUT" ;;
    fp8-micro)  # FP8_CONFIGS: launch shapes TILE_N:WARPS:STAGES beside the tiles
      python benchmarks/fp8_attn_micro.py --tiles "${FP8_TILES:-32,64,128}" \
        --configs "${FP8_CONFIGS:-}" --batches "${FP8_BATCHES:-32,128,256}" --out "$OUT" ;;
    fp8-b)  # Benchmark B's shapes, bf16 vs fp8 KV at equal KV memory (FP8_* knobs)
      python benchmarks/fp8_kv_gpu.py --num "${FP8_PROMPTS:-500}" --kv-gib "${FP8_KV_GIB:-12}" \
        --peer-num "${FP8_PEER:-32}" --shapes "${FP8_SHAPES:-1024x128,128x1024}" --out "$OUT" ;;
    pd-transfer)  # prefill/decode disaggregation on one GPU: colocated, then a producer and a
      # consumer per transport (PD_TRANSPORTS: file = through host memory, buffer = the
      # producer's device buffer read by CUDA IPC)
      df -h /dev/shm /tmp | sed 's/^/  /'
      python benchmarks/pd_transfer.py --model "${PD_MODEL:-qwen3-0.6b}" --load-format dummy \
        --device cuda --num-prompts "${PD_PROMPTS:-16}" --input-len "${PD_LEN:-4000}" \
        --transports "${PD_TRANSPORTS:-file,buffer}" ${PD_BUFFER:+--buffer "$PD_BUFFER"} \
        ${PD_GPUS:+--gpus "$PD_GPUS"} --out "$OUT" ;;  # PD_GPUS=0,1: producer, consumer
    pd-mixed)  # long prompts beside chat at rising rates: one engine vs a prefill/decode
      # pair behind the proxy (PD_GPUS=0,1 on two GPUs: the colocated engine on the first)
      python benchmarks/pd_mixed.py --device cuda ${PD_GPUS:+--gpus "$PD_GPUS"} \
        --model-name qwen3-0.6b --server-args "qwen3-0.6b --load-format dummy --max-model-len 8192" \
        --long-in 4000 --long-out 100 --chat-in 200 --chat-out 400 \
        --rates "${PD_RATES:-2,4,8,16}" --duration "${PD_DURATION:-20}" --out "$OUT" ;;
    kvc-d-quick) python benchmarks/kvcompress_throughput.py --model qwen3-0.6b --num-prompts 64 \
        --input-len 2000 --output-len 200 --max-model-len 4096 --kv-cache-memory-bytes 1073741824 \
        --rates "${KVC_RATES:-8,64}" --out "$OUT" | grep -v "^ " ;;
    kvc-d-fp8)  # kvc-d-quick's workload with the bf16 cache, then the fp8 cache (one call)
      for kv in auto fp8; do
        python benchmarks/kvcompress_throughput.py --model qwen3-0.6b --num-prompts 64 \
          --input-len 2000 --output-len 200 --max-model-len 4096 \
          --kv-cache-memory-bytes 1073741824 --rates "${KVC_RATES:-8,64}" --kv-cache-dtype $kv \
          --out "$OUT" | grep -v "^ "
      done ;;
    kvc-d-prefix)  # a 1,000-token prefix every prompt shares, prefix caching on and off
      python benchmarks/kvcompress_throughput.py --num-prompts "${KVC_PROMPTS:-256}" \
        --prefix-len "${KVC_PREFIX:-1000}" --rates "${KVC_RATES-64}" \
        --no-prefix-caching-rates "${KVC_NOCACHE-64}" --out "$OUT" | grep -v "^ " ;;
    kvc-d-uncapped)  # the whole GPU's memory for the KV cache
      python benchmarks/kvcompress_throughput.py --num-prompts "${KVC_PROMPTS:-256}" \
        --rates "${KVC_RATES:-64,8}" --kv-cache-memory-bytes 0 --out "$OUT" | grep -v "^ " ;;
    ab-d)  # Benchmark D's KV-Compress runs alternating a base tree in ab_base/ (made as for
      # ab-a) and this tree, AB_ROUNDS times, each against the uncompressed run of KVC_BASELINE
      base_json=$(realpath "$KVC_BASELINE")
      for i in $(seq "${AB_ROUNDS:-1}"); do
        (cd ab_base && PYTHONPATH=/tmp/site:$PWD KVC_BASELINE=$base_json kvc_d "$OUT/ab_base_$i")
        KVC_BASELINE=$base_json kvc_d "$OUT/ab_new_$i"
      done ;;
    kvc-overhead-a) python benchmarks/kvcompress_overhead.py a --rounds "${KVC_ROUNDS:-3}" \
        --out "$OUT" ;;
    kvc-overhead-b) python benchmarks/kvcompress_overhead.py b --rounds "${KVC_ROUNDS:-2}" \
        --b-shapes "${KVC_SHAPES:-128x1024,1024x128}" --out "$OUT" ;;
    # speculative decoding (SPEC_PROPOSERS, SPEC_REPEATS, SPEC_BATCHES)
    spec-draft) python benchmarks/spec_decode_gpu.py qwen3 --out "$OUT" | grep -v '"tokens"' ;;
    spec-draft-8b) python benchmarks/spec_decode_gpu.py llama8b --out "$OUT" ;;
    spec-cheap) python benchmarks/spec_decode_gpu.py cheap \
        ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} --repeats "${SPEC_REPEATS:-1}" \
        --out "$OUT" | grep -v '"tokens"' ;;
    spec-profile) python benchmarks/spec_decode_gpu.py profile \
        ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} --out "$OUT" | grep -v '"tokens"' ;;
    spec-paced) python benchmarks/spec_decode_gpu.py paced --repeats "${SPEC_REPEATS:-10}" \
        ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} --out "$OUT" | grep -v '"tokens"' ;;
    spec-ngram-gpu) python benchmarks/spec_decode_gpu.py paced --repeats "${SPEC_REPEATS:-4}" \
        --proposers "${SPEC_PROPOSERS:-ngram,ngram_gpu,suffix,ngram_gpu_paced}" \
        --batches "${SPEC_BATCHES:-1,16,64,256}" --tag ngram_gpu --out "$OUT" \
        | grep -v '"tokens"' ;;
    # the hybrid KV cache (Gemma 3's sliding-window layers), kernels
    hybrid-kv) python benchmarks/hybrid_kv_gpu.py --out "$OUT" | tail -40 ;;
    kernels) python benchmarks/attn_kernels.py --out-dir "$OUT" | tail -40 ;;
    attn-sweep) python benchmarks/attn_decode_sweep.py --layouts "${SWEEP_LAYOUTS:-nhd,kvcs}" \
        --out "$OUT/attn_decode_sweep.json" ;;
    # several GPUs: TP = N tokens against TP = 1, all-reduce times, Benchmark B by TP and DP
    so-equality) python benchmarks/scale_out_gpu.py equality --tp "${SO_TP:-1,2,4}" \
        --cases "${SO_CASES:-}" --out "$OUT" | tail -8 ;;
    so-allreduce) python benchmarks/scale_out_gpu.py allreduce --tp "${SO_AR:-2,4}" --out "$OUT" \
        | tail -3 ;;
    so-allreduce-micro) python benchmarks/allreduce_micro.py --world "${SO_WORLD:-2}" --out "$OUT" ;;
    so-tp) python benchmarks/scale_out_gpu.py bench-b --tp "${SO_TP:-1,2,4}" \
        --shapes "${SO_SHAPES:-128x1024,1024x128}" --out "$OUT" ;;
    so-dp) python benchmarks/scale_out_gpu.py bench-b-dp --dp "${SO_DP:-1,2}" \
        --shapes "${SO_SHAPES:-128x1024,1024x128}" --out "$OUT" ;;
    *) echo "unknown stage $1" ;;
  esac
}

if [ "${1:-}" = "--one" ]; then one "$2"; exit; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
for spec in "$@"; do
  stage=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=560
  echo "=== $stage $(date +%T) (limit ${limit}s)" | tee -a "$OUT/log.txt"
  timeout "$limit" bash "$0" --one "$stage" 2>&1 | tee -a "$OUT/log.txt" | tail -40
done
