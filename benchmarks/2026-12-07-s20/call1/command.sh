#!/usr/bin/env bash
# The sixteenth stop's one device call (tree 49ac3ee), run as ./command.sh 470 from the repo root
# (scratch_route_ab.py there: route_ab.py here).
export PYTHONPATH=$PWD
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
# an H100 host's profile (fifteenth stop) for the roofline's GPU rate; no calibration in this call
case "$gpu" in *H100*) cp benchmarks/2026-12-07-s19/call1/h200.json "$OUT/h200.json";; esac
timeout 90 python3 scratch_route_ab.py 2>&1 | tail -14
OUT=$OUT BENCH_TIME_S=${1:-530} ENV_AB="WORKBENCH_DEVICE_TILES=1 WORKBENCH_DEVICE_TILES=0 WORKBENCH_FUSED_ROUTING=1" \
    KERNELS_WEIGHTS=bf16 KERNELS_EXPERTS="128 8" CPU_PROMPT_TOKENS=1,2,4,5,8,12,16 \
    timeout $(( ${1:-530} + 10 )) scripts/bench_device.sh env_ab cache_out kernels decode_kernels cpu_prompt
rm -f "$OUT/h200.json"
cd "$OUT" && tar czf results.tar.gz --exclude=results.tar.gz --exclude=compile_cache.tar.xz --exclude=kernels.tar.gz . \
    && find . -maxdepth 1 -type f ! -name results.tar.gz ! -name compile_cache.tar.xz ! -name kernels.tar.gz ! -name device.log -delete
ls -la "$OUT"
