#!/usr/bin/env bash
# The eighteenth stop's second device call, on call 1's warm machine: calibration (the profile kept for calls 3-4).
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-570} timeout $(( ${1:-570} + 10 )) scripts/bench_device.sh restore calibrate keep
ls -la "$OUT"
