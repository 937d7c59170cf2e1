#!/usr/bin/env bash
# The device call prepared for the patch beside this script (docs/gpu-notes.md, version 30: a
# closed k-block's wait and addition taken after the next tile's barrier and copies; not yet
# timed). If it wins: `git am` the patch, run the GEMM device tests and the spill checks, then
# record every format (`bench_gpu_prefill.py --weights bf16,fp8,mxfp4,nvfp4,f32 --rows 64,2048
# --gemv-rows 0 --steps "" --no-hf --record`), as version 30's call 3 did.
bash docs/experiments/time_gemm_patch.sh docs/experiments/kblock-defer
