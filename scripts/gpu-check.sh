#!/usr/bin/env bash
# The GPU acceptance run (training/gpu_check.py: float8, async TP, attention backends, FSDP2 x TP): one command on a GPU machine, one JSON report.
#   scripts/gpu-check.sh                      # all local GPUs -> gpu-check.json (under 8 minutes on one H200)
#   scripts/gpu-check.sh --out /tmp/r.json    # elsewhere
#   scripts/gpu-check.sh --dry-run            # the plumbing on CPU (gloo, micro model): what CI runs
# Sections (training/gpu_check.py): environment; FSDP2 x TP + bf16 + compile over all local GPUs with
# tokens/s, MFU and NVML telemetry; float8 on the 1.2B class when the GPU has capability 8.9+; the
# largest size that fits one GPU at 256 px. Exit 1 when a section failed; the report says which and why.
# Needs the gpu extra on a GPU machine: pip install -e '.[gpu]' (torchao, nvidia-ml-py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
LIMIT_S="${GPU_CHECK_LIMIT_S:-480}"  # a hard stop: the sections budget themselves to 450 s
exec timeout --kill-after=20 "$LIMIT_S" "$PY" -m training.gpu_check "$@"
