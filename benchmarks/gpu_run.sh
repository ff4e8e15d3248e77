#!/usr/bin/env bash
# One device call: install the wheels the GPU image lacks (carried in .whl/), then run the
# named stages of the GPU check-and-time suite, each as STAGE or STAGE:SECONDS (a time limit).
# Usage (on the GPU machine, repo root):
#   bash benchmarks/gpu_run.sh bench-a-quick:240 check:200 tests:300 bench-a bench-b extras
# Results land in $OUT (the device tool's return folder); the log in $OUT/log.txt as it runs.
set -uo pipefail
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
if [ -d .whl ] && ! [ -f /tmp/site/.done ]; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false
# the grammar benchmark needs a real tokenizer: SmolLM2's, carried in .bench_tok/
[ -d .bench_tok ] && export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/.bench_tok}

summary() {  # the headline numbers of every bench-a variant in $1
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

one() {
  case $1 in
    tests) python -m pytest -q -x -p no:cacheprovider tests/kernels tests/models tests/engine ;;
    tests-fused) python -m pytest -q -x -p no:cacheprovider tests/kernels/test_fused_ops.py \
        tests/kernels/test_rms_norm.py ;;
    tests-attn) python -m pytest -q -x -p no:cacheprovider tests/kernels/test_paged_attention.py \
        tests/kernels/test_kv_write.py ;;
    tests-kernels) python -m pytest -q -x -p no:cacheprovider --durations=8 tests/kernels ;;
    tests-hf) python -m pytest -q -x -p no:cacheprovider tests/models/test_hf_equality.py
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_fused_ops.py -k rope_and_cache ;;
    tests-seams) python -m pytest -q -x -p no:cacheprovider tests/models/test_sample_rows.py \
        tests/models/test_parallel_and_beam.py tests/engine/test_executor.py ;;
    tests-models) python -m pytest -q -x -p no:cacheprovider tests/models tests/engine ;;
    tests-grammar) python -m pytest -q -x -p no:cacheprovider tests/kernels/test_bitmask.py \
        tests/engine/test_grammars.py tests/models/test_async_scheduling.py \
        -k "bitmask or grammar or rejected or worker or again" ;;
    check) python benchmarks/gpu_suite.py check --out "$OUT" ;;
    bench-a-quick) python benchmarks/gpu_suite.py bench-a --skip-peers --sync-too --time-device \
        --out "$OUT/quick" | grep -v "^ "; summary "$OUT/quick" ;;
    profile-a) python benchmarks/gpu_suite.py bench-a --skip-peers --time-device --profile \
        --out "$OUT/profile" | grep -v "^ "; summary "$OUT/profile"
      python -c "import glob,json; d=json.load(open(glob.glob('$OUT/profile/*bench-a*.json')[0]));
print(json.dumps(d['pagedllm_cuda_graphs']['phases'], indent=1));
print(json.dumps(d['kernel_profile'], indent=1))" ;;
    attn-sweep) python benchmarks/attn_decode_sweep.py --out "$OUT/attn_sweep.json" ;;
    attn-layout) python benchmarks/attn_decode_sweep.py --quick --layouts nhd,hnd \
        --out "$OUT/attn_layout.json" ;;
    kvc-attn-sweep) python benchmarks/attn_decode_sweep.py --layouts ${SWEEP_LAYOUTS:-nhd,kvc} \
        ${SWEEP_NARROW:+--narrow} --cases qwen3_ragged_100_2048,llama8b_ragged_128_1152 --out "$OUT/kvc_attn_sweep.json" ;;
    attn-quick) python benchmarks/attn_decode_sweep.py --quick --out "$OUT/attn_quick.json" ;;
    bench-a) python benchmarks/gpu_suite.py bench-a --sync-too --time-device --out "$OUT" | grep -v "^ ";
        summary "$OUT" ;;
    bench-b) python benchmarks/gpu_suite.py bench-b --out "$OUT" | tail -40 ;;
    extras) python benchmarks/gpu_suite.py extras --out "$OUT" | tail -40 ;;
    profile-structured) python benchmarks/profile_structured.py ;;
    bitmask-launch) python benchmarks/bitmask_launch.py ;;
    profile-structured-in-loop) GRAMMAR_PROCESS=0 python benchmarks/profile_structured.py ;;
    structured) python benchmarks/gpu_suite.py extras --only-structured --out "$OUT" | tail -30 ;;
    structured-threads) lscpu -e | head -20; nproc
      python benchmarks/gpu_suite.py extras --grammar-threads 1,2,4 --out "$OUT" | tail -5 ;;
    executor) python benchmarks/executor_overhead.py --preset bench-a --out "$OUT" | tail -25 ;;
    serving-qwen) python benchmarks/serving_gpu.py --shape qwen3-0.6b --out "$OUT" ;;
    serving-llama8b) python benchmarks/serving_gpu.py --shape llama-3.1-8b --single-prompts 8 \
        --out "$OUT" ;;
    tests-kvc) python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kvc_attention.py \
        tests/core/test_kvcompress.py tests/models/test_kvcompress.py ;;
    tests-kvc-split)  # the decode kernel's split paths (uneven heads, auto splits, rows in place)
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kvc_attention.py \
        -k "auto_splits or uneven or strided or row_ids or rows_in_place or warm_up or window" ;;
    tests-kvc-window)  # the window scores and the prefill kernel's normalizers on the GPU
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kvc_attention.py \
        -k "window_scores or backend_matches" ;;
    tests-long-tiles)  # long chunks' launch shape in both prefill kernels, on the GPU
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_paged_attention.py \
        -k "long_chunks" ;;
    tests-long-heads)  # the long-head split: kernels (uneven heads, auto, rows in place), graphs
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_kvc_attention.py \
        -k "uneven or auto_splits or rows_in_place or warm_up"
      python -m pytest -q -x -p no:cacheprovider tests/models/test_kvcompress.py -k "cuda_graphs" ;;
    tests-kvc-graphs)  # the KV-Compress decode graphs with and without the score pass
      python -m pytest -q -x -p no:cacheprovider tests/models/test_kvcompress.py -k "cuda_graphs or async" \
        tests/core/test_kvcompress.py tests/engine/test_pinned_ring.py ;;
    tests-kvc-async)  # async steps with KV-Compress evictions in flight (results first, graphs)
      python -m pytest -q -x -p no:cacheprovider tests/models/test_kvcompress.py \
        -k "async or in_flight" ;;
    tests-kvc-par)  # the KV-Compress GPU tests in 7 processes (Triton compiles in parallel)
      P="python -m pytest -q -x -p no:cacheprovider"
      K=tests/kernels/test_kvc_attention.py
      $P $K -k "test_decode and big-torch.bfloat16" > /tmp/t1 2>&1 &
      $P $K -k "test_decode and big-torch.float16" > /tmp/t2 2>&1 &
      $P $K -k "test_paged_mixed_batch and big-torch.bfloat16" > /tmp/t3 2>&1 &
      $P $K -k "test_paged_mixed_batch and big-torch.float16" > /tmp/t4 2>&1 &
      $P $K -k "not big" > /tmp/t5 2>&1 &
      $P tests/models/test_kvcompress.py > /tmp/t6 2>&1 &
      $P tests/core/test_kvcompress.py tests/kernels/test_fused_ops.py > /tmp/t7 2>&1 &
      wait; for f in /tmp/t[1-7]; do echo "--- $f"; tail -4 $f; done ;;
    kvc-d-quick) python benchmarks/kvcompress_throughput.py --model qwen3-0.6b --num-prompts 64 \
        --input-len 2000 --output-len 200 --max-model-len 4096 --kv-cache-memory-bytes 1073741824 \
        --rates ${KVC_RATES:-8,64} --eager-rates "${KVC_EAGER:-8}" --profile-dir "${KVC_PROFILE:-}" \
        --out "$OUT" | grep -v "^ " ;;
    kvc-d-8b) python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-64} \
        --output-len ${KVC_OUT:-500} --rates ${KVC_RATES:-1,2,4,8,16,32,64} \
        --eager-rates "${KVC_EAGER:-none}" --out "$OUT" | grep -v "^ " ;;
    tests-spec) python -m pytest -q -x -p no:cacheprovider --durations=5 \
        tests/models/test_spec_decode.py ;;
    spec-draft)  # a draft model: tok/s vs acceptance, batch 1-256, k 2 and 4 (Qwen3-0.6B shape)
      python benchmarks/spec_decode_gpu.py qwen3 --out "$OUT" | grep -v '"tokens"' ;;
    spec-profile)  # batch 1: ms per step and a host profile, with / without a draft model
      # (SPEC_PROPOSERS=plain,ngram,ngram_gpu: those on the saved random weights instead)
      python benchmarks/spec_decode_gpu.py profile ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} \
        --out "$OUT" | grep -v '"tokens"' ;;
    tests-spec-graphs)  # the multi-token-row graphs: kernel tests, then speculation end to end
      python -m pytest -q -x -p no:cacheprovider tests/kernels/test_paged_attention.py \
        -k "speculative or short_rows or cuda_graph" && \
      python -m pytest -q -x -p no:cacheprovider --durations=5 tests/models/test_spec_decode.py ;;
    spec-cheap)  # n-gram, suffix and first-layers drafts vs none, batch 1-256 (Qwen3-0.6B shape)
      python benchmarks/spec_decode_gpu.py cheap ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} \
        --repeats ${SPEC_REPEATS:-1} \
        --out "$OUT" | grep -v '"tokens"' ;;
    spec-paced)  # disable_when_slower: engines side by side, timed runs interleaved
      python benchmarks/spec_decode_gpu.py paced --repeats ${SPEC_REPEATS:-3} --trace \
        ${SPEC_PROPOSERS:+--proposers $SPEC_PROPOSERS} --out "$OUT" | grep -v '"tokens"' ;;
    tests-ngram-gpu)  # ngram_gpu on CUDA: the device lookup, correction and verification,
      # then greedy equality with async steps (chunked, prefix, preemption, structured, limits)
      python -m pytest -q -x -p no:cacheprovider --durations=8 tests/spec_decode/test_ngram_gpu.py \
        tests/kernels/test_spec_drafts.py \
        tests/models/test_spec_decode.py -k "test_ngram_gpu or lookup or correction or \
        verification or delta or every_arch and qwen3 or engine_features or beside_structured \
        or limits or seeded or distribution" ;;
    ngram-gpu-micro) python benchmarks/ngram_gpu_micro.py --torch --out "$OUT" ;;
    spec-ngram-gpu)  # ngram_gpu (async) against ngram (sync steps), suffix and no speculation
      python benchmarks/spec_decode_gpu.py paced --repeats ${SPEC_REPEATS:-5} \
        --proposers ${SPEC_PROPOSERS:-ngram,ngram_gpu,suffix,ngram_gpu_paced} \
        --batches ${SPEC_BATCHES:-1,16,64,256} --out "$OUT" | grep -v '"tokens"' ;;
    spec-draft-8b)  # Llama-3.1-8B shape with a Llama-3.2-1B-shaped draft (dummy weights)
      python benchmarks/spec_decode_gpu.py llama8b --out "$OUT" ;;
    kvc-d-prefix)  # Benchmark D with a system prompt every prompt shares, prefix caching on/off
      python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-256} \
        --prefix-len ${KVC_PREFIX:-1000} --rates "${KVC_RATES-64}" \
        --no-prefix-caching-rates "${KVC_NOCACHE-64}" --out "$OUT" | grep -v "^ " ;;
    kvc-d-goal4)  # cr 64 with CUDA graphs + chunked prefill, chunked prefill off, eager
      python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-64} \
        --rates ${KVC_RATES:-64} --eager-rates ${KVC_EAGER:-64} \
        --no-chunked-prefill-rates ${KVC_NOCHUNK:-64} --out "$OUT" | grep "^in " ;;
    kvc-d-profile)  # one input length's uncompressed run and KV-Compress runs, each KVC run's
      # host side under cProfile (where a step's host time goes: KVC_LEN, KVC_RATES)
      python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-256} \
        --input-len ${KVC_LEN:-500} --rates ${KVC_RATES:-64} --profile-dir "$OUT/profiles" \
        --out "$OUT" | grep "^in "
      for f in "$OUT"/profiles/*.txt; do echo "== $f"; head -40 "$f" | tail -32; done ;;
    kvc-d-kprofile)  # KV-Compress runs of one length with the device time by kernel of a
      # window of steps (KVC_KPROF=START:COUNT) and the heads' lengths the kernels read; the
      # uncompressed run from an earlier call's file (KVC_BASELINE)
      python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-256} \
        --input-len ${KVC_LEN:-6000} --rates ${KVC_RATES:-8,64} --kernel-profile \
        ${KVC_KPROF:-600:60} --baseline-json "$KVC_BASELINE" --out "$OUT" | grep "^in " ;;
    kvc-d-uncapped)  # the paper's 256 prompts with the whole GPU's memory for the KV cache
      python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-256} \
        --rates ${KVC_RATES:-64,8} --kv-cache-memory-bytes 0 --out "$OUT" | grep "^in " ;;
    kvc-d-sweep) python benchmarks/kvcompress_throughput.py --num-prompts ${KVC_PROMPTS:-64} \
        --output-len ${KVC_OUT:-500} --input-lens ${KVC_LENS:-500,2000,14000} --rates ${KVC_RATES:-8,64} \
        --max-num-seqs ${KVC_SEQS:-256} ${KVC_BASELINE:+--baseline-json $KVC_BASELINE} \
        --out "$OUT" | grep -v "^ " ;;  # (KVC_BASELINE: one length only)
    kvc-micro)  # one eviction step's device time at the 8B shape, by kernel (prompt, make-room)
      python benchmarks/kvc_compress_micro.py --out "$OUT" ;;
    kvc-window)  # a prompt's window scores, one layer of the 8B shape: torch against the kernel
      python benchmarks/kvc_window_micro.py --out "$OUT" ;;
    attn-prefill-sweep)  # the prefill kernels' launch shapes on long prompts, flash SDPA beside
      python benchmarks/attn_prefill_sweep.py --out "$OUT" ;;
    kvc-skew)  # the per-head decode kernel on even and uneven heads of one mean, splits 1-8
      # (KVC_SKEW_CASES rows x mean, KVC_SKEW_KINDS, KVC_SKEW_CONFIGS S:M, lS:M:T heads past T tiles
      # split, @TILE:WARPS:STAGES a launch shape)
      python benchmarks/kvc_decode_skew.py --out "$OUT" ${KVC_SKEW_CASES:+--cases $KVC_SKEW_CASES} \
        ${KVC_SKEW_KINDS:+--kinds $KVC_SKEW_KINDS} ${KVC_SKEW_CONFIGS:+--configs $KVC_SKEW_CONFIGS} ;;
    kvc-evict-check)  # each eviction's KVs kept against its budget, heads nothing left (8B, cr 32)
      python benchmarks/kvc_eviction_check.py --num-prompts ${KVC_PROMPTS:-16} \
        --max-cache-tokens ${KVC_M:-176} --out "$OUT" | tail -2 ;;
    kvc-d-skew-ab)  # cr 64 at 6,000 with the uneven-head decode splits on, then off (the
      # uncompressed run from an earlier call's file: KVC_BASELINE); on first: a call cut short keeps it
      for v in ${KVC_SKEW:-8:16} 0; do
        PAGEDLLM_KVC_SKEW_SPLITS=$v python benchmarks/kvcompress_throughput.py --num-prompts \
          ${KVC_PROMPTS:-256} --input-len ${KVC_LEN:-6000} --rates ${KVC_RATES:-64} \
          --baseline-json "$KVC_BASELINE" --out "$OUT/skew_${v/:/_}" | grep "^in "
      done ;;
    kvc-overhead) python benchmarks/gpu_suite.py bench-a --skip-peers --kvc-too --time-device \
        --out "$OUT" | grep -v "^ "; summary "$OUT"
      python benchmarks/gpu_suite.py bench-b --skip-peers --kvc-too --num-b ${KVC_NUM_B:-256} \
        --warm-b 256 --warm-out 32 --out "$OUT" | grep -E "output_tokens_per_s|^wrote" | head -20 ;;
    kvc-ab-a)  # KV-Compress off / on (never evicts) side by side, alternating timed runs
      python benchmarks/kvc_overhead_ab.py a --rounds ${KVC_ROUNDS:-3} --out "$OUT" ;;
    kvc-ab-b) python benchmarks/kvc_overhead_ab.py b --rounds ${KVC_ROUNDS:-2} \
        --b-shapes ${KVC_SHAPES:-128x1024,1024x128} --out "$OUT" ;;
    kvc-tiles)  # the KV-Compress decode kernel's launch shapes inside the engine, off run twice
      python benchmarks/gpu_suite.py bench-a --skip-peers --time-device --repeat-off \
        --kvc-tiles ${KVC_TILES:-64:4:2,128:4:3} --out "$OUT" | grep -v "^ "; summary "$OUT"
      python benchmarks/gpu_suite.py bench-b --skip-peers --repeat-off --b-shapes 128x1024 \
        --kvc-tiles ${KVC_TILES:-64:4:2,128:4:3} --num-b 256 --warm-b 256 --warm-out 32 --out "$OUT" \
        | grep -E "^wrote" ;;
    kvc-profile)  # Benchmark A, KV-Compress off vs on with no budget: device time by kernel
      python benchmarks/gpu_suite.py bench-a --skip-peers --kvc-too --time-device --profile \
        --out "$OUT/kvc_profile" | grep -v "^ "; summary "$OUT/kvc_profile"
      python -c "import glob,json; d=json.load(open(glob.glob('$OUT/kvc_profile/*bench-a*.json')[0]));
[print(k, json.dumps(d[k], indent=1)) for k in d if k.startswith('kernel_profile')];
[print(k, json.dumps(d[k]['phases'], indent=1)) for k in d if k.startswith('pagedllm_')]" ;;
    kvc-host-profile)  # Benchmark A's workload through bench throughput, cProfile of the host
      # side, KV-Compress off and on without a budget (where the host time of a step goes)
      for kvc in "" --enable-kvc; do
        tag=${kvc:+_kvc}
        python -m pagedllm.entrypoints.cli bench throughput --model qwen3-0.6b --load-format dummy \
          --dtype bfloat16 --num-prompts 256 --input-len 562 --output-len 562 --range-ratio 0.82 \
          --max-model-len 2048 $kvc --profile-host "$OUT/host_profile$tag.txt" \
          --output-json "$OUT/host_profile$tag.json" | tail -2
        python -c "import json; d=json.load(open('$OUT/host_profile$tag.json')); print('$tag',
{k: d.get(k) for k in ('output_tokens_per_s','elapsed_s','steps','host_ms_per_decode_step_mean',
'device_ms_per_step_mean','device_busy_fraction')})"
        head -60 "$OUT/host_profile$tag.txt" | tail -52
      done ;;
    host-phases) python benchmarks/host_phases.py --out "$OUT"
      python benchmarks/host_phases.py --variants kvc --gc-off --out "$OUT" ;;
    kvc-d) python benchmarks/kvcompress_throughput.py --out "$OUT" | tail -40 ;;
    hybrid-kv) python benchmarks/hybrid_kv_gpu.py --out "$OUT" | tail -40 ;;
    hybrid-kv-profile) python benchmarks/hybrid_kv_gpu.py --profile | grep -v "^$" | head -120 ;;
    ab-a)  # Benchmark A (no peers) alternating: a base tree in ab_base/, this tree, base, this
      # tree. Make the base first (git-ignored: pass carry ["ab_base"] to the device call):
      #   mkdir ab_base && git archive COMMIT pagedllm benchmarks pyproject.toml | tar -x -C ab_base
      for i in 1 2; do
        (cd ab_base && PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_suite.py bench-a \
          --skip-peers --time-device --out "$OUT/ab_base_$i" | grep -v "^ ")
        python benchmarks/gpu_suite.py bench-a --skip-peers --time-device --out "$OUT/ab_new_$i" \
          | grep -v "^ "
      done
      for d in "$OUT"/ab_*; do echo "$d"; summary "$d"; done ;;
    # several GPUs (issues 20 and 22): TP=N vs TP=1 tokens, NCCL all-reduce times, Benchmark B
    # at each TP size, then at DP = 1 and 2 behind the async front end
    so-equality) python benchmarks/scale_out_gpu.py equality --tp ${SO_TP:-1,2,4} --out "$OUT" \
        --cases "${SO_CASES:-}" \
        | tail -8 ;;
    so-allreduce) python benchmarks/scale_out_gpu.py allreduce --tp ${SO_AR:-2,4} --out "$OUT" \
        | tail -3 ;;
    so-tp) python benchmarks/scale_out_gpu.py bench-b --tp ${SO_TP:-1,2,4} \
        --shapes ${SO_SHAPES:-128x1024,1024x128} --out "$OUT" ;;
    so-profile)  # where a TP step's time goes: engine phases, each rank's calls, device time
      for b in ${SO_BACKENDS:-uni mp}; do
        tps=${SO_TP:-1,2,4}; [ "$b" = uni ] && tps=1
        python benchmarks/scale_out_gpu.py bench-b --tp $tps --backend $b --shapes 128x1024 \
          --num ${SO_NUM:-512} --profile --profile-at ${SO_PROFILE_AT:-400} --out "$OUT/profile" \
          | grep -v '^{' ; done
      python benchmarks/scale_out_gpu.py show-profile --out "$OUT/profile" ;;
    so-dp) python benchmarks/scale_out_gpu.py bench-b-dp --dp ${SO_DP:-1,2} \
        --shapes ${SO_SHAPES:-128x1024,1024x128} --out "$OUT" ;;
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
