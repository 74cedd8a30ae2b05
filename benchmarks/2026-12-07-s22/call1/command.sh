#!/usr/bin/env bash
# The eighteenth stop's first device call, run as benchmarks/2026-12-07-s22/call1/command.sh from the repo root,
# carrying .whl_engine, .compile_cache and llama-bench's pack part 00 (kept for call 3): the CUDA tests of the
# unit split (served decode, the one-token kernels over unit views) and of the prompt's placed sums.
export PYTHONPATH=$PWD
OUT=$OUT BENCH_TIME_S=${1:-560} TESTS_TIME_S=220 \
    SERVED_TESTS="tests/engine/test_served.py tests/engine/test_gpu_kernels.py tests/engine/test_served_team.py" \
    BENCH_PROMPT_TESTS="tests/engine/test_prefill_kernels.py tests/engine/test_kernel_check.py" \
    timeout $(( ${1:-560} + 10 )) scripts/bench_device.sh served_tests prompt_tests cache_out keep
ls -la "$OUT"
