#!/usr/bin/env bash
# The eighteenth stop's second device call, on call 1's warm machine (its profile and pack part kept), carrying
# llama-bench's pack parts 01 and 02: side by side with llama.cpp (bf16 skewed, uniform, Q8_0), ours with the unit
# split the model picks per layer, and the split's A/B (frequency, balanced with WORKBENCH_BUS_UNITS=0: whole experts).
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-575} AB_STRATEGIES=frequency,balanced ENV_AB="WORKBENCH_BUS_UNITS=0" \
    timeout $(( ${1:-575} + 10 )) scripts/bench_device.sh restore build engine env_ab engine_uniform engine_q8 placements
rm -f "$OUT/h200.json"; ls -la "$OUT"
