#!/usr/bin/env bash
# The eighteenth stop's third device call (call 1's profile): the unit split forced at 0.5 in every hybrid layer
# (n-cpu-moe, frequency, balanced planned in that order, as stage engine plans them), then S1 as Q4_K side by side.
export PYTHONPATH=$PWD
mkdir -p "$OUT"; cp benchmarks/2026-12-07-s22/call1/h200.json "$OUT/h200.json"
OUT=$OUT BENCH_TIME_S=${1:-300} AB_STRATEGIES=n-cpu-moe,frequency,balanced ENV_AB="WORKBENCH_BUS_UNITS=0.5" \
    timeout $(( ${1:-300} + 10 )) scripts/bench_device.sh restore build env_ab engine_q4
rm -f "$OUT/h200.json"; ls -la "$OUT"
