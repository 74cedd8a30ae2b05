#!/usr/bin/env bash
# The eighteenth stop's third device call, on the same warm machine, carrying llama-bench's pack parts 01 and 02:
# side by side with llama.cpp (bf16 skewed and uniform, Q8_0), ours with the unit split the model picks per layer.
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-570} timeout $(( ${1:-570} + 10 )) \
    scripts/bench_device.sh restore build engine engine_uniform engine_q8 placements keep
rm -f "$OUT/h200.json"; ls -la "$OUT"
