#!/usr/bin/env bash
# Layer the kvpress peer over a GPU machine's own Python without a network: kvpress 0.5.5 pins
# transformers<5.3 while the machine's image carries a newer transformers, so kvpress,
# transformers 5.2.0 and the few packages the image lacks (or has in a version transformers 5.2
# refuses) are installed from carried wheels into a folder of their own that goes FIRST on
# PYTHONPATH; torch, numpy, huggingface_hub, pyarrow, pandas, ... stay the image's.
#
#   bash benchmarks/peers/kvpress_gpu_setup.sh [SITE]       # default /tmp/kvp_site
#   PYTHONPATH=/tmp/kvp_site python3 benchmarks/peers/kvpress_run.py --device cuda \
#       --dtype bfloat16 ...
#
# The wheels (git-ignored folder .whl_kvp/, about 15 MB; WHL_DIR overrides it, PYTHON the
# interpreter) are fetched on a machine with the registry, for CPython 3.12 on x86-64 Linux:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl_kvp kvpress==0.5.5 transformers==5.2.0 \
#     tokenizers==0.22.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 termcolor==3.3.0 \
#     cachetools==5.5.2
#   pip wheel --no-deps -w .whl_kvp fire==0.6.0          # fire 0.6 ships no wheel of its own
# Why each: transformers 5.2 checks tokenizers<=0.23.0 at import; `import kvpress` imports
# datasets (-> dill, multiprocess), fire (-> termcolor; six from the image) and cachetools; the
# versions follow kvpress's pins (fire<0.7, cachetools<6). The check below imports everything
# and fails loudly if the image's torch / huggingface_hub / pyarrow do not fit.
set -euo pipefail

SITE="${1:-/tmp/kvp_site}"
WHL_DIR="${WHL_DIR:-.whl_kvp}"
PYTHON="${PYTHON:-python3}"

shopt -s nullglob
wheels=("$WHL_DIR"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "no wheels in $WHL_DIR (see this script's header)" >&2
  exit 1
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "${wheels[@]}"

PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" KVP_SITE="$SITE" "$PYTHON" - <<'PY'
import importlib.metadata as md
import os
import sys

# Hub kernels are code downloaded at run time (never wanted here), and a `kernels` package newer
# than transformers 5.2 breaks its import: hide it, as kvpress_run.py does.
sys.modules["kernels"] = None

import torch
import transformers

import kvpress

site = os.path.realpath(os.environ["KVP_SITE"])
print("python", sys.version.split()[0])
for pkg in ("kvpress", "transformers", "tokenizers", "datasets", "huggingface_hub", "torch"):
    print(pkg, md.version(pkg))
assert transformers.__version__ == "5.2.0", transformers.__version__
assert os.path.realpath(transformers.__file__).startswith(site), transformers.__file__
assert not os.path.realpath(torch.__file__).startswith(site), "torch must be the image's"
print("cuda", torch.cuda.is_available(), torch.cuda.device_count())
print("kvpress presses:", ", ".join(sorted(n for n in dir(kvpress) if n.endswith("Press"))))
PY
