#!/bin/bash
# Issues 37 and 50's device check in one call (bench/gpu_check.py says what it measures).
#
# On a lent H100/H200, from the worktree's root, after `make install` and then ../shared/gpu/wheels.sh
# (it builds this worktree into .whl/, so run it after your last change), with Liger Kernel beside it (pure
# Python; the machine has Triton):
#     python3 -m pip download -q --no-deps liger-kernel==0.8.5 -d .whl
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# It installs the wheels into /tmp/site, prints the GPU, and runs every part within a 420 s budget;
# the last line is `result: engine_tok_s_b64=... ...`. One part alone: `bash bench/gpu_check.sh --parts learner`
# (`--parts learner,liger` for issue 50's learner figures).
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
exec timeout 480 python3 bench/gpu_check.py "$@"
