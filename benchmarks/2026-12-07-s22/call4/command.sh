#!/usr/bin/env bash
# The eighteenth stop's fourth device call (as run, inline), on the same warm machine: the prompt's token sums A/B,
# S1 bf16 all on the GPU with WORKBENCH_TOKEN_SUMS=0 (the path before the seventeenth stop) and 1 (token sums, placed store).
mkdir -p $OUT && cp benchmarks/2026-12-07-s22/call1/h200.json $OUT/h200.json && PYTHONPATH=$PWD OUT=$OUT BENCH_TIME_S=170 \
    ENV_AB="WORKBENCH_TOKEN_SUMS=0 WORKBENCH_TOKEN_SUMS=1" timeout 180 scripts/bench_device.sh env_ab; rm -f $OUT/h200.json
