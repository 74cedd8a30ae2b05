#!/usr/bin/env bash
# The seventeenth stop's first device call, run as benchmarks/2026-12-07-s21/call1/command.sh from the repo root,
# carrying .whl_engine, .compile_cache and llama-bench's pack parts 00 and 01 (kept for call 2).
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-575} TESTS_TIME_S=100 \
    BENCH_PROMPT_TESTS="tests/engine/test_prefill_kernels.py tests/engine/test_experts_hot_path.py" \
    ENV_AB="WORKBENCH_TOKEN_SUMS=0 WORKBENCH_FUSED_ROUTING=0 WORKBENCH_FUSED_ROUTING=1" \
    timeout $(( ${1:-575} + 10 )) scripts/bench_device.sh prompt_tests calibrate cache_out keep env_ab
cd "$OUT" && ls ab_*.json >/dev/null 2>&1 && tar czf ab.tar.gz ab_*.json && rm -f ab_*.json
ls -la "$OUT"
