#!/usr/bin/env bash
# The seventeenth stop's second device call, on call 1's warm machine (its profile and pack parts kept), run as
# benchmarks/2026-12-07-s21/call2/command.sh from the repo root, carrying llama-bench's pack part 02.
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-575} PREFILL_N_CPU_MOE=0 \
    timeout $(( ${1:-575} + 10 )) scripts/bench_device.sh restore build engine prefill engine_q8 engine_uniform placements engine_q4
rm -f "$OUT/h200.json"; ls -la "$OUT"
