#!/usr/bin/env bash
# The eighteenth stop's first device call, run as benchmarks/2026-12-07-s22/call1/command.sh from the repo root,
# carrying .whl_engine, .compile_cache and llama-bench's pack part 00 (kept for call 2): the CUDA tests of the
# unit split (served decode, the one-token kernels over unit views) and of the prompt's placed sums, then calibration.
export PYTHONPATH=$PWD
t=tests/engine
OUT=$OUT BENCH_TIME_S=${1:-570} TESTS_TIME_S=150 \
    SERVED_TESTS="$t/test_served.py::test_a_unit_split_shares_every_cpu_pair_between_the_cpu_and_the_bus
        $t/test_served.py::test_served_steps_give_the_reference_tokens $t/test_served.py::test_a_bus_share_reads_the_cpu_stacks_in_place
        $t/test_gpu_kernels.py::test_experts_one_token_over_a_part_of_each_experts_units" \
    BENCH_PROMPT_TESTS="$t/test_prefill_kernels.py $t/test_kernel_check.py" \
    timeout $(( ${1:-570} + 10 )) scripts/bench_device.sh served_tests prompt_tests calibrate cache_out keep
ls -la "$OUT"
