#!/usr/bin/env bash
# The device call that timed the patch beside this script (docs/gpu-notes.md, version 30: tile
# kt + AHEAD's copies issued after tile kt's wgmmas; bf16 0.93-0.99x, mxfp4 0.99-1.08x, dropped).
# The call itself copied each source in turn; this runs the same cases with `git apply`.
bash docs/experiments/time_gemm_patch.sh docs/experiments/late-issue
