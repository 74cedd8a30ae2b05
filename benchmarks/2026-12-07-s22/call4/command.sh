#!/usr/bin/env bash
# The eighteenth stop's fourth device call, on the same warm machine: the unit split's A/B on S1 bf16 skewed
# (frequency, balanced) with WORKBENCH_BUS_UNITS=0 (whole experts) and unset (the model's split), then Q4_K.
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-570} AB_STRATEGIES=frequency,balanced \
    ENV_AB="WORKBENCH_BUS_UNITS=0 WORKBENCH_BUS_UNITS= WORKBENCH_BUS_UNITS=0" \
    timeout $(( ${1:-570} + 10 )) scripts/bench_device.sh restore build env_ab engine_q4
cd "$OUT" && ls ab_*.json >/dev/null 2>&1 && tar czf ab.tar.gz ab_*.json && rm -f ab_*.json
rm -f "$OUT/h200.json"; ls -la "$OUT"
