#!/usr/bin/env bash
# Train smol-qwen2-vl's reading codes and vision tower on a GPU machine (see docs/history/vlm-2026.md).
# Needs artifacts/ from `python -m training.vision_codes pack --out artifacts` and
# `... prepare --out artifacts/codes_data.json`; writes into ${OUT:-out}/.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
export PYTHONPATH=$PWD
"$PY" -m training.vision_codes tune --data artifacts --out "$OUT/codes.safetensors" \
  --steps "${CODE_STEPS:-600}" --batch "${CODE_BATCH:-64}" --eval "${EVAL_N:-400}" \
  --device "${DEVICE:-cuda}" 2>&1 | tee "$OUT/codes.log" | cut -c1-3000 | tail -30
if "$PY" -c "import transformers, PIL, safetensors" 2>/dev/null && [ -f "$OUT/codes.safetensors" ]; then
  timeout "${TOWER_LIMIT:-200}" "$PY" -m training.vision_train --codes "$OUT/codes.safetensors" \
    --out "$OUT/smol_vlm_vision.safetensors" --steps "${TOWER_STEPS:-3000}" --batch "${TOWER_BATCH:-64}" \
    --frames "${TOWER_FRAMES:-20000}" --workers "${WORKERS:-14}" --device "${DEVICE:-cuda}" 2>&1 | tee "$OUT/tower.log" | tail -12
else
  echo "no transformers/PIL/safetensors here: tower not trained"
fi
