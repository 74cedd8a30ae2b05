#!/usr/bin/env bash
# The eighteenth stop's fifth device call (as run, inline), carrying llama-bench's pack parts 01 and 02 (part 00 kept by
# call 1): S1 as Q4_K side by side (call 3's llama-bench had been lost to a partial unpack).
mkdir -p $OUT && cp benchmarks/2026-12-07-s22/call1/h200.json $OUT/h200.json && PYTHONPATH=$PWD OUT=$OUT BENCH_TIME_S=150 \
    timeout 160 scripts/bench_device.sh restore build engine_q4; rm -f $OUT/h200.json
