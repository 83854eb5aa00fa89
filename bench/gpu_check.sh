#!/bin/bash
# Issue 37's device check in one call (bench/gpu_check.py says what it measures).
#
# On a lent H100/H200, from the worktree's root, after `make install` and then ../shared/gpu/wheels.sh
# (it builds this worktree into .whl/, so run it after your last change):
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=400)
# It installs the wheels into /tmp/site, prints the GPU, and runs every part within a 320 s budget;
# the last line is `result: engine_tok_s_b64=... ...`.
#
# Here, on the CPU with tiny shapes (the same parts, end to end; uses .venv):
#     bash bench/gpu_check.sh --tiny
set -u
if [[ " $* " == *" --tiny "* ]]; then
  exec env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/gpu_check.py "$@"
fi
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
exec timeout 360 python3 bench/gpu_check.py "$@"
