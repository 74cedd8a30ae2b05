#!/usr/bin/env bash
# What runs on the GPU machine for the S1 baselines (BENCHMARKS.md). From the repo root, with
# .llamacpp carried (scripts/build_llamacpp.sh fetch; gguf wheel in .llamacpp/whl):
#
#   OUT=/path scripts/bench_device.sh STAGE...
#
# Stages: build (llama-bench for sm_90, skipped if .llamacpp/bin/llama-bench exists), s1 (write S1
# skewed; llama-bench --n-cpu-moe 16 (the 12 GiB budget), 24 and all on GPU), s1more (-ot
# variants and --n-cpu-moe 14/15/17), cpu (CPU expert formats),
# uniform (S1 reskewed to uniform routing; llama-bench), q8, q4 (S1 as Q8_0 / Q4_K; llama-bench),
# nommap (llama-bench -lm none: weights read into buffers, not mmap'd), tests (tests/engine on CUDA),
# write (the S1 skewed file only), prefill (scripts/profile_prefill.py: a 512-token prompt at
# n-cpu-moe 17 under several bus/CPU splits), prefill_frequency (the same for the frequency placement of S1 Q8_0
# and bf16 at the budget, planned and saved by a short run of ours), contention (scripts/time_bus_contention.py: the bus's
# copies and the CPU's expert reads alone and at once; $OUT/contention.json), prefill_ab (scripts/profile_prefill.py
# with timelines on saved placements: this tree, 16 bus slots, an earlier tree, torch's copies instead of the driver's
# (BENCH_PREFILL_VARIANTS="new old slots16 torchcopies early2"; early2: two batches fetched before the CPU's setup); $OUT/prefill_ab.tar.gz), prompt_tests (bus share, grouped
# kernels and CPU kernel prompt tests on CUDA; carry .whl_engine; BENCH_PROMPT_TESTS: other files), refit_prompt
# (workbench calibrate --refit-prompt on $OUT/h200.json: a hybrid prompt layer's host time, the time more with a CPU share, the prompt's copy rate), profile_saved (scripts/profile_hybrid.py over the
# placements stage engine ran, saved under /tmp/wb_placements), keep / restore (the profile and llama-bench left in
# /tmp/wb_keep for the next call while the machine stays warm, and taken back by it; BENCH_KEPT_FITS (q8_0,q4_k):
# the kept formats whose GPU rate stage calibrate fits), profile (scripts/profile_hybrid.py for n-cpu-moe and frequency at
# 12 GiB, then scripts/profile_decode.py into $OUT/decode), kernels (scripts/profile_decode.py all on the GPU
# on a 4-layer cut of S1, bf16 and Q8_0 (KERNELS_WEIGHTS): each kernel's time and the gaps between them; $OUT/kernels.tar.gz),
# decode_kernels (scripts/time_decode_kernels.py: each form of the step's kernels at S1's shapes; $OUT/decode_kernels.json),
# pdl_ab (S1 all on the GPU with and without programmatic dependent launch (WORKBENCH_PDL=0 turns it off) and the Triton dense matvec),
# pdl_tests (tests/engine/test_decode_in_place.py on CUDA under those settings), bus_ab (S1 bf16 n-cpu-moe and frequency with
# decode's bus share balanced by the calibrated rates, then at BUS_AB_SHARES (0.45); after stage calibrate), env_ab (S1 all on the GPU under each of ENV_AB's environments),
# calibrate ($OUT/h200.json, then the profile of the stages after it), engine (`workbench bench
# run`: llama.cpp -lm none at --n-cpu-moe 16 and all-GPU, then our n-cpu-moe, frequency, balanced
# and all-GPU (BENCH_ALL_GPU=0: not all-GPU), with the ratios), kernel_tests (the fused CPU kernel's
# tests on this machine's CPU), engine_uniform (the same, routers rewritten uniform), engine_q8
# (S1 as Q8_0, llama.cpp at --n-cpu-moe 8), engine_q4 (S1 as Q4_K), cap_tests (the VRAM cap on CUDA), gpu_tests
# (the Triton kernels', VRAM cap's, spinning team's and hot path's tests on CUDA), served (scripts/profile_hybrid.py
# with and without the decode server), served_tests (its tests and the bus share's on CUDA), fit_probe
# (scripts/probe_engine_fit.py three times after stage calibrate), wide_probe (scripts/probe_wide_fit.py: the kernel
# cost and the routing's cost per expert beyond those picked, alone, on $OUT/h200.json or WIDE_PROFILE), prompt_kernels (tests/engine/test_prefill_kernels.py on
# CUDA and scripts/time_prompt_kernels.py), dense_kernels (tests/engine/test_packed.py on CUDA and
# scripts/time_dense_kernels.py: kept Q8_0/Q4_K/Q6_K projections and head against bf16), placements (those the side-by-side stages ran,
# as $OUT/placements.tar.gz), pack (llama-bench binary
# as $OUT/llama-bench.tar.xz.part-NN; carried back as .llamacpp/pack/, stage build unpacks it),
# trace (scripts/trace_served.py: S1 Q8_0 and bf16 decode split by the decode server's clock on saved placements; $OUT/trace.tar.gz;
# TRACE_ENVS="WORKBENCH_SERVED_DIRECT=0" traces the packets copied by the stream against the publish kernel's own
# writes, the default),
# handoff (scripts/time_served_handoff.py, both server teams), handoff_sparse (the same, spinning team, with one and four picks in
# every layer and then in 40% of them: a sparse placement's layers), cpu_sweep (the same for Q8_0 by read-ahead hint, distance and threads), engine_team (S1 bf16 and Q8_0 with the
# decode server's passes on torch's OpenMP pool), engine_alt (the same, ours only, under BENCH_ALT_ENV's settings), cpu_prompt (scripts/time_cpu_prompt.py: the fused kernel by tokens
# per expert against torch's GEMMs; $OUT/cpu_prompt.json), cpu_vs_ggml (scripts/time_cpu_vs_ggml.py:
# one token's CPU experts, ours against llama.cpp's ggml, built from .llamacpp/ggml-src.tar.xz (carry it:
# scripts/build_llamacpp.sh ggml-pack); $OUT/cpu_vs_ggml.json), engine_q4_hybrid (S1 as Q4_K at BENCH_Q4_BUDGET (4GiB): most experts on the
# CPU, the case of a large Q4_K model on a small GPU; BENCH_HYBRID_WEIGHTS=q3_k (or q2_k, iq4_xs) writes S1
# in that format instead), engine_gpt_oss (gpt-oss-120b's MoE shape, MXFP4 experts, 18 of 36 layers at 12 GiB:
# ours and llama.cpp's --n-cpu-moe; BENCH_CALIBRATE_KQUANTS=q4_k,mxfp4 has stage calibrate time MXFP4). BENCH_BUDGET (12GiB) sets the side-by-side budget.
# At most 8 files come back per call: choose the stages of one call accordingly.
# BENCH_ENGINE_GEN / BENCH_ENGINE_REPEATS (64 / 3: one neighbour's burst moves the median of two), BENCH_MARGIN (512MiB) and LLAMA_N_CPU_MOE tune
# the side-by-side stages. Stage candidates: scripts/check_kernel_candidates.py (each autotuning
# candidate of the one-token kernels against PyTorch at S1's shapes, and what the engine's check keeps;
# $OUT/candidates.txt); stage explore: the same with more forms tried ($OUT/explore.txt).
# Before a call after a change to the GPU kernels, scripts/check_kernels_compile.py compiles them here for sm_90
# (with the GPU machine's Triton on PYTHONPATH): a kernel that does not build would cost the call.
# Stage cache_out returns what the call compiled ($OUT/compile_cache.tar.xz); put it in .compile_cache/ (ignored)
# and carry that folder: the next call's machine starts from it instead of compiling again.
# After a change to the GPU kernels, run served_tests (and gpu_tests) before the side-by-side stages: the
# served decode's bus runs the expert kernels over page-locked host stacks, a path only CUDA exercises, and
# a failure there sends the hybrid layers back to host-driven steps (the bench prints a WARNING per run).
# The llama-bench pack (~42 MB) and the tree (~33 MB) exceed what one call carries (64 MiB): carry parts 00 and 01
# with a first call that ends in stage keep, then part 02 with the next call on the same warm machine, starting
# with stages restore build (BENCHMARKS.md, thirteenth stop).
# A session's run in one call (~560 s; carry .llamacpp/pack, or .llamacpp after
# `scripts/build_llamacpp.sh fetch` (stage build then takes ~250 s in the background), and .llamacpp/whl):
#   OUT=$OUT BENCH_ALL_GPU=0 BENCH_TIME_S=570 CANDIDATES_TIME_S=150 scripts/bench_device.sh build candidates \
#       calibrate engine_q4 engine_q8 engine engine_uniform placements
# (BENCH_TIME_S skips what would start too late; the first process on a fresh machine also compiles
# every autotuning candidate of the Triton kernels, and stage candidates checks them all)
# The decode server's passes run on its own spinning threads (WORKBENCH_SERVER_TEAM=spin, the default;
# omp: torch's OpenMP pool). Stage handoff compares both; stage engine_team runs ours on S1 bf16 and
# Q8_0 with the pool, to set against stages engine and engine_q8 of the same call.
# and the engine's other CUDA tests in a second call: OUT=$OUT scripts/bench_device.sh tests  (carry .whl_engine)
# To skip stage calibrate (~90 s), carry a profile from an earlier call (e.g. .dev/h200.json, ignored)
# and copy it to $OUT/h200.json first: the side-by-side stages predict with $OUT/h200.json when present.
# BENCH_TIME_S (default 540) bounds the whole script: llama-bench configurations that would start
# too late are skipped and reported as such.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/bench-out}"
mkdir -p "$OUT"
t0=$(date +%s)
budget_s="${BENCH_TIME_S:-540}"
left() { echo $(( budget_s - ($(date +%s) - t0) )); }
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/device.log"; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site"
log "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)"
log "NUMA nodes online: $(cat /sys/devices/system/node/online 2>/dev/null || echo unknown); $(lscpu 2>/dev/null | grep -i 'numa node[0-9]' | tr -s ' ' | paste -sd ';' -)"
for whl in .whl_engine .llamacpp/whl; do  # transformers and gguf wheels, as pinned here
    if [ -d "$whl" ] && ls "$whl"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl; break
    fi
done
cache_pack=.compile_cache/compile_cache.tar.xz  # what stage cache_out returned on an earlier call, carried back
if [ -f "$cache_pack" ]; then  # Triton's compiled kernels and the fused CPU kernel's build: no compile here again
    if files=$(tar -C "$HOME" -xvJf "$cache_pack"); then log "compile cache restored: $(grep -vc '/$' <<<"$files") files"
    else log "compile cache not restored (tar failed)"; fi
    # the build's outputs newer than the sources this call's copy just wrote, or ninja builds them again
    [ -d "$HOME/.cache/moe-workbench/torch_ext" ] && find "$HOME/.cache/moe-workbench/torch_ext" -type f -exec touch {} +
fi
models="${BENCH_MODELS:-/dev/shm/wb}"
layers="${BENCH_LAYERS:+--layers $BENCH_LAYERS}"  # dry runs: fewer layers
mkdir -p "$models"
wb() { python3 -m workbench -v bench "$@" 2>>"$OUT/device.log"; }
lbench() {  # label json args...
    local label="$1" json="$2"; shift 2
    local tl=$(( $(left) - 20 ))
    if [ "$tl" -lt 40 ]; then log "skip llama-bench $label: out of time"; return; fi
    log "llama-bench $label ($tl s left)"
    wb llamacpp --label "$label" --json "$OUT/$json" --time-limit "$tl" "$@" | tee -a "$OUT/device.log"
}
build_pid=""

stage_build() {
    if [ ! -x .llamacpp/bin/llama-bench ] && ls .llamacpp/pack/llama-bench.tar.xz.part-* >/dev/null 2>&1; then
        cat .llamacpp/pack/llama-bench.tar.xz.part-* | xz -d | tar -C .llamacpp -xf - && log "llama-bench unpacked"
    fi
    if [ -x .llamacpp/bin/llama-bench ] && .llamacpp/bin/llama-bench --help >/dev/null 2>&1; then
        log "llama-bench present"; return
    fi
    log "building llama-bench in the background"
    scripts/build_llamacpp.sh build >"$OUT/build.log" 2>&1 &
    build_pid=$!
}
wait_build() {
    if [ -n "$build_pid" ]; then wait "$build_pid"; log "build exit $?"; build_pid=""; tail -2 "$OUT/build.log"; fi
    [ -x .llamacpp/bin/llama-bench ] || { log "no llama-bench"; return 1; }
}
stage_s1() {
    log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5 | tee -a "$OUT/device.log"
    wait_build || return
    lbench "S1 bf16 skewed" llamacpp_s1_skew.json --model "$models/s1.gguf" --n-cpu-moe 16,24 --all-gpu
}
stage_s1more() {  # finer placements around the budget (S1 file from stage s1)
    wait_build || return
    lbench "S1 bf16 skewed, around the budget" llamacpp_s1_skew_more.json --model "$models/s1.gguf" --n-cpu-moe 15,17,14 --ot-around 16
}
stage_cpu() {
    log "CPU formats"; wb cpu-formats --shape s1 --threads 16 --experts 128 --pool 1,2,4,8 --json "$OUT/cpu_formats.json" | tee -a "$OUT/device.log"
}
stage_uniform() {
    [ -f "$models/s1.gguf" ] || { log "writing S1 uniform"; wb write -o "$models/s1.gguf" --shape s1 $layers --uniform; }
    wb reskew "$models/s1.gguf" --uniform | tee -a "$OUT/device.log"
    wait_build || return
    lbench "S1 bf16 uniform" llamacpp_s1_uniform.json --model "$models/s1.gguf" --n-cpu-moe 16,24
}
stage_q8() {
    rm -f "$models"/s1.gguf
    log "writing S1 Q8_0"; wb write -o "$models/s1_q8.gguf" --shape s1 $layers --weights q8_0 | tee -a "$OUT/device.log"
    wait_build || return
    lbench "S1 Q8_0 skewed" llamacpp_s1_q8.json --model "$models/s1_q8.gguf" --n-cpu-moe 7,8,9 --all-gpu
    rm -f "$models"/s1_q8.gguf
}
stage_q4() {
    rm -f "$models"/s1.gguf
    log "writing S1 Q4_K"; wb write -o "$models/s1_q4.gguf" --shape s1 $layers --weights q4_k | tee -a "$OUT/device.log"
    wait_build || return
    lbench "S1 Q4_K skewed" llamacpp_s1_q4.json --model "$models/s1_q4.gguf" --n-cpu-moe 0,2 --all-gpu
    rm -f "$models"/s1_q4.gguf
}
stage_pack() {  # the binary in parts of < 16 MB (files from $OUT come back up to 16 MiB each)
    wait_build || return
    tar -C .llamacpp -cf - bin COMMIT | xz -T4 -6 | split -b 15000000 -d - "$OUT/llama-bench.tar.xz.part-"
    log "packed llama-bench: $(cat "$OUT"/llama-bench.tar.xz.part-* | wc -c) bytes in $(ls "$OUT"/llama-bench.tar.xz.part-* | wc -l) parts"
    log "next time: copy them to .llamacpp/pack/ and carry .llamacpp/pack instead of building"
}
stage_nommap() {  # llama.cpp reading the model into (pinned) buffers instead of mmap: its faster mode
    [ -f "$models/s1.gguf" ] || { log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5; }
    wait_build || return
    lbench "S1 bf16 skewed, -lm none" llamacpp_s1_skew_nommap.json --model "$models/s1.gguf" \
        --n-cpu-moe 16,24,17 --all-gpu "--llama-args=-lm none"
}
side_by_side() {  # file label json strategies [args...]: llama.cpp (-lm none) then our engine, one command
    local file="$1" label="$2" json="$3" strategies="$4" side=() prof=bench-h200
    shift 4
    wait_build && side=(--llama-bench .llamacpp/bin/llama-bench --llama-n-cpu-moe "${LLAMA_N_CPU_MOE:-16}" "--llama-args=-lm none")
    [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    local tl=$(( $(left) - 20 ))
    log "side by side: $label ($tl s left)"
    wb run --model "$file" --budget "${BENCH_BUDGET:-12GiB}" --margin "${BENCH_MARGIN:-512MiB}" --profile "$prof" \
        --strategies "$strategies" -p 512 -n "${BENCH_ENGINE_GEN:-64}" -r "${BENCH_ENGINE_REPEATS:-3}" \
        --time-limit "$tl" "${side[@]}" "$@" --json "$OUT/$json" --save-placements "/tmp/wb_placements/${json%.json}" \
        | tee -a "$OUT/device.log"
}
stage_tests() {  # the engine's tests on CUDA (carry .whl_engine: transformers and gguf as pinned here)
    log "tests"; WORKBENCH_TEST_DEVICE=cuda timeout "${TESTS_TIME_S:-240}" python3 -m pytest -q -p no:cacheprovider \
        tests/engine >"$OUT/cuda_tests.txt" 2>&1; log "tests rc $?"; tail -3 "$OUT/cuda_tests.txt" | tee -a "$OUT/device.log"
}
stage_gpu_tests() {  # the CUDA kernels' and the decode server's tests on this GPU (carry .llamacpp/whl: gguf)
    log "gpu tests"; WORKBENCH_TEST_DEVICE=cuda timeout "${TESTS_TIME_S:-240}" python3 -m pytest -q -p no:cacheprovider \
        tests/engine/test_gpu_kernels.py tests/engine/test_packed.py tests/engine/test_prefill_kernels.py \
        tests/engine/test_memory_cap.py tests/engine/test_served_team.py tests/engine/test_experts_hot_path.py \
        >"$OUT/gpu_tests.txt" 2>&1; log "gpu tests rc $?"; tail -3 "$OUT/gpu_tests.txt" | tee -a "$OUT/device.log"
}
stage_cap_tests() {  # the engine's VRAM cap on CUDA (carry .llamacpp/whl: gguf)
    log "cap tests"; WORKBENCH_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
        tests/engine/test_memory_cap.py >"$OUT/cap_tests.txt" 2>&1; log "cap tests rc $?"; tail -3 "$OUT/cap_tests.txt" | tee -a "$OUT/device.log"
}
stage_handoff() {  # the decode server's hand-off per hybrid layer against the CPU experts' own time
    for f in "bf16 0,1,2" "q8_0 0,1,2,3"; do set -- $f
        timeout 120 python3 scripts/time_served_handoff.py --format "$1" --picks "$2" 2>&1 | tee -a "$OUT/handoff.txt"
    done
    tail -8 "$OUT/handoff.txt" >>"$OUT/device.log"
}
stage_handoff_sparse() {  # the same with one and four picks in every layer, then in 40% of them (the rest empty),
    # 70 us of the host's wait between layers: does a sparse layer's round trip cost more than a busy one's?
    for f in bf16 q8_0; do
        timeout 150 python3 scripts/time_served_handoff.py --format "$f" --picks 1,4 --every 1,0.4 --gap-us 70 \
            --team spin --cpu-only 2>&1 | tee -a "$OUT/handoff_sparse.txt"
    done
    tail -10 "$OUT/handoff_sparse.txt" >>"$OUT/device.log"
}
stage_trace() {  # S1 Q8_0 and bf16 decode split by the decode server's own clock (scripts/trace_served.py) on the
    # placements stage engine / engine_q8 saved (else the twelfth stop call 1's, from benchmarks/): each packet's CPU time,
    # each layer's span with and without CPU pairs, the hand-off beyond the CPU's work; $OUT/trace.tar.gz
    local p=/tmp/wb_trace; rm -rf "$p"; mkdir -p "$p/json"
    [ -d /tmp/wb_placements/engine_s1_q8 ] || tar -C "$p" -xzf benchmarks/2026-12-07-s16/call1/placements.tar.gz
    # TRACE_Q8 / TRACE_BF16: the placements (none: that format skipped); TRACE_ENVS: settings each is
    # traced under, beside the defaults (e.g. "WORKBENCH_SERVER_CHUNKS=4 WORKBENCH_SERVER_THREADS=14")
    for f in "q8_0 s1_q8 engine_s1_q8 ${TRACE_Q8-frequency,n-cpu-moe,balanced}" \
             "bf16 s1 engine_s1_skew ${TRACE_BF16-frequency,n-cpu-moe}"; do set -- $f
        [ -n "${4:-}" ] || continue
        [ -f "$models/$2.gguf" ] || { rm -f "$models"/s1*.gguf; log "writing S1 $1"
            wb write -o "$models/$2.gguf" --shape s1 $layers --coverage 0.5 --weights "$1" | tee -a "$OUT/device.log"; }
        for st in ${4//,/ }; do
            local pl=/tmp/wb_placements/$3/$st.json; [ -f "$pl" ] || pl="$p/$3/$st.json"
            for setting in default ${TRACE_ENVS:-}; do
                [ "$(left)" -gt 45 ] || { log "skip trace $1 $st $setting: out of time"; continue; }
                local envs=(); [ "$setting" != default ] && envs=("$setting")
                log "trace $1 $st $setting"; env "${envs[@]}" timeout 120 python3 scripts/trace_served.py \
                    --model "$models/$2.gguf" --device cuda --placement "$pl" --steps 96 \
                    --json "$p/json/$1_${st}_${setting//[=]/-}.json" 2>>"$OUT/device.log" | tee -a "$OUT/trace.txt"
            done
        done
        rm -f "$models/$2.gguf"
    done
    cat "$OUT/trace.txt" >>"$OUT/device.log"
    tar -C "$p/json" -czf "$OUT/trace.tar.gz" .
}
stage_cpu_sweep() {  # one token's Q8_0 CPU experts through the decode server by read-ahead (CPU_PREFETCH_SWEEP: hint:bytes,
    # WORKBENCH_CPU_PREFETCH_HINT / _BYTES) and server threads (CPU_THREADS_SWEEP): the fit over 1, 2, 4 picks splits fixed and per-expert cost
    for v in ${CPU_PREFETCH_SWEEP:-0:2048 0:0 0:4096 1:2048 1:4096 1:8192 2:4096}; do for th in ${CPU_THREADS_SWEEP:-15}; do
        echo "prefetch hint ${v%%:*} bytes ${v##*:} threads $th" >>"$OUT/cpu_sweep.txt"
        WORKBENCH_CPU_PREFETCH_HINT=${v%%:*} WORKBENCH_CPU_PREFETCH_BYTES=${v##*:} timeout 100 python3 scripts/time_served_handoff.py \
            --format q8_0 --picks 1,2,4 --team spin --threads "$th" --cpu-only 2>&1 | grep -v "^ *$" >>"$OUT/cpu_sweep.txt"
    done; done
    grep -E "^prefetch|fixed per packet" "$OUT/cpu_sweep.txt" | tee -a "$OUT/device.log"
}
stage_cpu_prompt() {  # a prompt's CPU-tier experts on the fused kernel by tokens per expert, and torch's GEMMs
    # (CPU_PROMPT_TOKENS: the counts; the fused kernel takes tokens four at a time, and calibration times it at 16
    # alone, so the counts between show how far a straight line through 1 and 16 is off for a cold expert's few)
    timeout 240 python3 scripts/time_cpu_prompt.py --formats bf16,q8_0,q4_k --tokens "${CPU_PROMPT_TOKENS:-1,2,3,4,5,8,12,16,32}" --gemm \
        --json "$OUT/cpu_prompt.json" 2>&1 | tee -a "$OUT/device.log"
}
stage_cpu_vs_ggml() {  # one token's CPU experts: ours (int8 and exact dots) against llama.cpp's ggml, same threads
    [ -f .llamacpp/build-ggml/src/libggml-cpu.a ] || scripts/build_llamacpp.sh ggml-cpu >"$OUT/build_ggml.log" 2>&1 \
        || { log "ggml CPU build failed"; tail -3 "$OUT/build_ggml.log"; return; }
    timeout 240 python3 scripts/time_cpu_vs_ggml.py --formats "${BENCH_GGML_FORMATS:-bf16,q8_0,q4_k,q3_k,iq4_xs}" --threads "$(( $(nproc) - 1 ))" \
        --experts 128 --json "$OUT/cpu_vs_ggml.json" 2>&1 | tee -a "$OUT/device.log"
}
stage_engine_q4_hybrid() {  # S1 as Q4_K under a small budget: most experts on the CPU (a large Q4_K model, a small GPU)
    local w="${BENCH_HYBRID_WEIGHTS:-q4_k}"  # or q2_k, q3_k, iq4_xs: the formats of a 235B-A22B in 128 GB of RAM
    local tag=""; [ "$w" != q4_k ] && tag="_$w"
    rm -f "$models"/s1.gguf
    log "writing S1 $w"; wb write -o "$models/s1_hyb.gguf" --shape s1 $layers --weights "$w" | tee -a "$OUT/device.log"
    BENCH_BUDGET="${BENCH_Q4_BUDGET:-4GiB}" LLAMA_N_CPU_MOE="${LLAMA_N_CPU_MOE:-15,16,17}" \
        side_by_side "$models/s1_hyb.gguf" "S1 $w skewed, ${BENCH_Q4_BUDGET:-4GiB}" "engine_s1_q4_hybrid$tag.json" "n-cpu-moe,frequency"
    rm -f "$models"/s1_hyb.gguf
}
stage_engine_gpt_oss() {  # gpt-oss-120b's MoE shape with MXFP4 experts (bf16 rest), BENCH_GPT_OSS_LAYERS (18) of its
    # 36 layers at the 12 GiB budget (a 24 GB card scaled as S1 is), llama.cpp at --n-cpu-moe 12-14: the target
    # user's gpt-oss-120b (qwen3moe layout: no biases nor sinks, so both engines run the same file)
    rm -f "$models"/s1.gguf "$models"/s1_q8.gguf
    log "writing gpt-oss-120b-like MXFP4"; wb write -o "$models/gpt_oss_mx.gguf" --shape gpt-oss-120b-like \
        --layers "${BENCH_GPT_OSS_LAYERS:-18}" --weights mxfp4 | tee -a "$OUT/device.log"
    LLAMA_N_CPU_MOE="${LLAMA_N_CPU_MOE:-12,13,14}" side_by_side "$models/gpt_oss_mx.gguf" \
        "gpt-oss-120b-like MXFP4, ${BENCH_GPT_OSS_LAYERS:-18} layers" engine_gpt_oss_mxfp4.json "n-cpu-moe,frequency"
    rm -f "$models"/gpt_oss_mx.gguf
}
stage_engine_team() {  # S1 skewed bf16 and Q8_0, ours only, the decode server's passes on torch's OpenMP pool (the default: its own spinning team)
    BENCH_ALT_ENV=WORKBENCH_SERVER_TEAM=omp BENCH_ALT_TAG=team stage_engine_alt
}
stage_engine_alt() {  # S1 skewed bf16 and Q8_0, ours only, under the settings BENCH_ALT_ENV (e.g. WORKBENCH_HUGE_PAGES=0),
    # results as engine_s1_skew_$BENCH_ALT_TAG.json / engine_s1_q8_$BENCH_ALT_TAG.json: set against stages engine, engine_q8
    local alt="${BENCH_ALT_ENV:-WORKBENCH_SERVER_TEAM=omp}" tag="${BENCH_ALT_TAG:-alt}"
    if [ -f "$models/s1.gguf" ]; then wb reskew "$models/s1.gguf" --coverage 0.5 | tee -a "$OUT/device.log"
    else log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5; fi
    local prof=bench-h200; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    for f in "$models/s1.gguf engine_s1_skew_$tag.json n-cpu-moe,frequency,balanced" \
             "$models/s1_q8.gguf engine_s1_q8_$tag.json n-cpu-moe,frequency"; do set -- $f
        if [ "$1" = "$models/s1_q8.gguf" ]; then
            rm -f "$models"/s1.gguf; wb write -o "$1" --shape s1 $layers --weights q8_0 | tee -a "$OUT/device.log"
        fi
        log "ours with $alt: $1 ($(left) s left)"
        env $alt python3 -m workbench -v bench run --model "$1" --budget 12GiB --margin "${BENCH_MARGIN:-512MiB}" \
            --profile "$prof" --strategies "$3" -p 512 -n "${BENCH_ENGINE_GEN:-64}" -r "${BENCH_ENGINE_REPEATS:-3}" \
            --time-limit $(( $(left) - 20 )) --json "$OUT/$2" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
    done
    rm -f "$models"/s1_q8.gguf
}
stage_write() {  # the S1 skewed file only
    [ -f "$models/s1.gguf" ] || { log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5 | tee -a "$OUT/device.log"; }
}
stage_profile() {  # host-time phases of hybrid layers (scripts/profile_hybrid.py) and the decode profile,
    stage_write     # as one file $OUT/profile.tar.gz (few files come back per call)
    local p=/tmp/wb_profile_out; rm -rf "$p"; mkdir -p "$p"
    for st in n-cpu-moe frequency; do
        log "profile_hybrid $st"; timeout 150 python3 scripts/profile_hybrid.py --model "$models/s1.gguf" --device cuda \
            --budget 12GiB --strategy "$st" --json "$p/hybrid_$st.json" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
    done
    log "profile_decode"; timeout 200 python3 scripts/profile_decode.py --model "$models/s1.gguf" --device cuda \
        --budget 12GiB --margin 512MiB --out "$p/decode" 2>>"$OUT/device.log" | tail -30 | tee -a "$OUT/device.log"
    tar -C "$p" -czf "$OUT/profile.tar.gz" .
}
stage_decode_kernels() {  # each form of one decode step's kernels at S1's shapes (scripts/time_decode_kernels.py)
    timeout 240 python3 scripts/time_decode_kernels.py --json "$OUT/decode_kernels.json" >"$OUT/decode_kernels.txt" 2>&1
    log "decode_kernels rc $?"; tail -5 "$OUT/decode_kernels.txt" | tee -a "$OUT/device.log"
}
stage_kernels() {  # one decode step's kernels all on the GPU: a 4-layer cut of S1 in bf16 and Q8_0 (scripts/profile_decode.py)
    local p=/tmp/wb_kernels; rm -rf "$p"; mkdir -p "$p"
    # KERNELS_EXPERTS (e.g. "128 8"): the cut with that many experts a layer, routing uniform (what picking 8 of 128 costs)
    for w in ${KERNELS_WEIGHTS:-bf16 q8_0}; do for e in ${KERNELS_EXPERTS:-shape}; do
        local ex=(); [ "$e" != shape ] && ex=(--experts "$e")
        log "profile_decode all-gpu $w ${ex[*]}"; timeout 240 python3 scripts/profile_decode.py --shape s1 --layers 4 \
            --weights "$w" "${ex[@]}" --device cuda --strategies all-gpu --steps 32 --out "$p/$w${ex:+_$e}" 2>>"$OUT/device.log" \
            | tail -3 | tee -a "$OUT/device.log"
    done; done
    tar -C "$p" -czf "$OUT/kernels.tar.gz" .
}
stage_prefill() {  # a prompt's time under several bus/CPU splits (scripts/profile_prefill.py) at --n-cpu-moe
    # PREFILL_N_CPU_MOE (17; 0: all on the GPU, the resident layers' kernels and host calls alone); $OUT/prefill.tar.gz
    stage_write
    local p=/tmp/wb_prefill; rm -rf "$p"
    log "profile_prefill"; timeout 200 python3 scripts/profile_prefill.py --model "$models/s1.gguf" --device cuda \
        --n-cpu-moe "${PREFILL_N_CPU_MOE:-17}" --out "$p" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
    [ -d "$p" ] && tar -C "$p" -czf "$OUT/prefill.tar.gz" .
}
stage_prefill_frequency() {  # where a frequency placement's prompt goes (S1 Q8_0 and bf16 at the budget; ours
    # ran 2.9x / 1.7x below the cost model's prompt there, while its n-cpu-moe prompts met it)
    local prof=bench-h200; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    for w in ${BENCH_PREFILL_WEIGHTS:-q8_0 bf16}; do
        local f="$models/s1_pf.gguf" p=/tmp/wb_placements/prefill_$w
        rm -f "$models"/*.gguf; rm -rf "$p"
        wb write -o "$f" --shape s1 $layers --weights "$w" --coverage 0.5 | tee -a "$OUT/device.log"
        log "plan and run frequency (after n-cpu-moe, whose run gives it the routing counts), $w ($(left) s left)"
        python3 -m workbench -v bench run --model "$f" --budget "${BENCH_BUDGET:-12GiB}" --margin "${BENCH_MARGIN:-512MiB}" \
            --profile "$prof" --strategies n-cpu-moe,frequency -p 512 -n "${BENCH_PF_GEN:-16}" -r "${BENCH_PF_REPEATS:-1}" --time-limit $(( $(left) - 20 )) \
            --save-placements "$p" --json "$OUT/prefill_$w.json" 2>>"$OUT/device.log" | tail -3 | tee -a "$OUT/device.log"
        mkdir -p "$OUT/prefill_$w" && cp "$p"/*.json "$OUT/prefill_$w/" 2>/dev/null  # to re-predict here
        log "profile_prefill frequency $w"
        timeout 150 python3 scripts/profile_prefill.py --model "$f" --device cuda --placement "$p/frequency.json" \
            --profile "$prof" --out "$OUT/prefill_$w" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
    done
    rm -f "$models"/s1_pf.gguf
    (cd "$OUT" && tar czf prefill_frequency.tar.gz prefill_q8_0 prefill_bf16 2>/dev/null && rm -rf prefill_q8_0 prefill_bf16)
}
stage_prefill_ab() {  # the prompt of saved placements ($BENCH_PREFILL_PLACEMENTS/<weights>_<strategy>.json) under
    # this tree's engine, the same with WORKBENCH_BUS_SLOTS=16, and (BENCH_OLD_TREE: a folder holding an earlier
    # workbench package, carried) under that one; scripts/profile_prefill.py with timelines, as $OUT/prefill_ab.tar.gz
    local dir="${BENCH_PREFILL_PLACEMENTS:?set BENCH_PREFILL_PLACEMENTS}" f="$models/s1_pf.gguf" pf="$OUT/pf"
    local prof=bench-h200 w p v; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    mkdir -p "$pf"
    for w in ${BENCH_PREFILL_WEIGHTS:-q8_0 bf16}; do
        rm -f "$models"/*.gguf
        wb write -o "$f" --shape s1 $layers --weights "$w" --coverage 0.5 | tee -a "$OUT/device.log"
        for p in "$dir"/"${w}"_*.json; do
            local st; st=$(basename "$p" .json)
            for v in ${BENCH_PREFILL_VARIANTS:-new old slots16}; do
                local env=() path="$PWD"
                [ "$v" = old ] && { [ -d "${BENCH_OLD_TREE:-}" ] || continue; path="$(cd "$BENCH_OLD_TREE" && pwd)"; }
                [ "$v" = slots16 ] && env=(WORKBENCH_BUS_SLOTS=16)
                [ "$v" = torchcopies ] && env=(WORKBENCH_NATIVE_COPIES=0)
                [ "$v" = early2 ] && env=(WORKBENCH_EARLY_BATCHES=2)
                [ "$(left)" -lt 40 ] && { log "no time left for $st $v"; continue; }
                log "profile_prefill $st $v ($(left) s left)"
                env "${env[@]}" PYTHONPATH="$path:/tmp/site" timeout 120 python3 scripts/profile_prefill.py --model "$f" \
                    --device cuda --placement "$p" --profile "$prof" --out "$pf/${st}_$v" 2>>"$OUT/device.log" \
                    | tee -a "$OUT/device.log"
            done
        done
    done
    rm -f "$f"; tar czf "$OUT/prefill_ab.tar.gz" -C "$OUT" pf && rm -rf "$pf"
}
stage_contention() {  # the bus's copies and the CPU's expert reads, alone and at once (scripts/time_bus_contention.py)
    log "bus against CPU contention"; timeout 120 python3 scripts/time_bus_contention.py --threads ${BENCH_CONTENTION_THREADS:-4,8,15} \
        --json "$OUT/contention.json" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
}
stage_prompt_tests() {  # the prompt paths' tests on CUDA: bus share, grouped kernels, CPU kernel (carry .whl_engine;
    # BENCH_PROMPT_TESTS: other test files)
    log "prompt tests"; WORKBENCH_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider \
        ${BENCH_PROMPT_TESTS:-tests/engine/test_bus_share.py tests/engine/test_prefill_kernels.py tests/engine/test_cpu_kernel_prompt.py} \
        >"$OUT/prompt_tests.txt" 2>&1; log "prompt tests rc $?"; tail -3 "$OUT/prompt_tests.txt" | tee -a "$OUT/device.log"
}
stage_refit_prompt() {  # the prompt's host costs and copy rate fitted on top of $OUT/h200.json (workbench calibrate --refit-prompt)
    [ -f "$OUT/h200.json" ] || { log "refit_prompt needs \$OUT/h200.json"; return; }
    log "refit prompt"; timeout 200 python3 -m workbench -v calibrate --refit-prompt "$OUT/h200.json" -o "$OUT/h200.json" \
        2>>"$OUT/device.log" | tail -3 | tee -a "$OUT/device.log"; grep -h "engine prompt" "$OUT/device.log" | tail -1
}
stage_profile_saved() {  # decode host phases (scripts/profile_hybrid.py) of the placements the skewed run ran
    local p=/tmp/wb_profile_saved; rm -rf "$p"; mkdir -p "$p"
    for f in /tmp/wb_placements/engine_s1_skew/*.json; do
        [ -f "$f" ] || { log "no saved placements: run stage engine first"; return; }
        local st; st=$(basename "$f" .json)
        log "profile_hybrid $st (saved)"; timeout 120 python3 scripts/profile_hybrid.py --model "$models/s1.gguf" \
            --device cuda --placement "$f" --json "$p/hybrid_$st.json" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
    done
    tar -C "$p" -czf "$OUT/profile_saved.tar.gz" .
}
stage_served() {  # decode host phases with the decode server (default) and without it, same placements
    stage_write
    for st in frequency n-cpu-moe; do
        for mode in auto off; do
            log "profile_hybrid $st served=$mode"; WORKBENCH_SERVED=$mode timeout 150 python3 scripts/profile_hybrid.py \
                --model "$models/s1.gguf" --device cuda --budget 12GiB --strategy "$st" \
                2>>"$OUT/device.log" | tee -a "$OUT/device.log"
        done
    done
}
stage_bus_sweep() {  # decode of the saved skewed placements (.dev/placements, from stage placements) under bus shares
    stage_write
    local p=.dev/placements/engine_s1_skew
    for run in "frequency 0" "frequency 0.45" "frequency 1" "frequency 0.3" "frequency 0.45 0" "n-cpu-moe 0" "n-cpu-moe 1" \
               "n-cpu-moe 0.45"; do
        set -- $run
        log "profile_hybrid $1 bus share $2 side stream ${3:-1}"; WORKBENCH_BUS_SHARE=$2 WORKBENCH_SERVED_BUS_STREAM=${3:-1} \
            timeout 100 python3 scripts/profile_hybrid.py --model "$models/s1.gguf" --device cuda --placement "$p/$1.json" \
            2>>"$OUT/device.log" | grep -E "decode server|total|^s1" | tee -a "$OUT/device.log"
    done
}
stage_served_tests() {  # the decode server's and the bus share's tests on CUDA (carry .whl_engine)
    log "served tests"; WORKBENCH_TEST_DEVICE=cuda timeout "${TESTS_TIME_S:-240}" python3 -m pytest -q -p no:cacheprovider \
        ${SERVED_TESTS:-tests/engine/test_served.py tests/engine/test_bus_share.py} >"$OUT/served_tests.txt" 2>&1
    log "served tests rc $?"; tail -3 "$OUT/served_tests.txt" | tee -a "$OUT/device.log"
}
stage_prompt_kernels() {  # the grouped prompt kernels' tests on CUDA and their timing (carry .llamacpp/whl: gguf)
    WORKBENCH_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_prefill_kernels.py \
        >>"$OUT/device.log" 2>&1; log "prompt kernel tests rc $?"  # in the log: few files come back per call
    timeout 120 python3 scripts/time_prompt_kernels.py 2>&1 | tail -4 | tee -a "$OUT/device.log"
}
stage_dense_kernels() {  # dense weights kept in GGUF blocks: their tests on CUDA and their timing at S1 shapes
    WORKBENCH_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_packed.py \
        >>"$OUT/device.log" 2>&1; log "dense kernel tests rc $?"
    timeout 150 python3 scripts/time_dense_kernels.py 2>&1 | tee -a "$OUT/device.log"
}
stage_candidates() {  # every autotuning candidate of the one-token kernels against PyTorch, then what the engine keeps
    WORKBENCH_AUTOTUNE=1 timeout "${CANDIDATES_TIME_S:-240}" python3 scripts/check_kernel_candidates.py \
        >"$OUT/candidates.txt" 2>&1; log "candidates rc $?"
    grep -E "checked and autotuned|WRONG|FAILED|everywhere" "$OUT/candidates.txt" | cut -c1-160 | tee -a "$OUT/device.log"
}
stage_explore() {  # the one-token kernels' candidates plus EXPLORE's forms, Q4_K / Q8_0 / bf16 experts and q/k/v, o
    timeout "${EXPLORE_TIME_S:-200}" python3 scripts/check_kernel_candidates.py --explore --formats q4_k,q8_0,bf16 \
        --experts "${EXPLORE_EXPERTS:-q4_k,q8_0,bf16}" --dense qkv,o --no-prompt >"$OUT/explore.txt" 2>&1
    log "explore rc $?"
}
stage_fit_probe() {  # calibration's engine fit three times in fresh processes (needs $OUT/h200.json: stage calibrate first)
    for i in 1 2 3; do python3 scripts/probe_engine_fit.py fresh "$OUT/h200.json" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"; done
}
stage_wide_probe() {  # the kernel cost and the routing's cost per expert alone (scripts/probe_wide_fit.py, ~2 min) on top of
    # $OUT/h200.json (stage calibrate or restore first) or WIDE_PROFILE; writes $OUT/h200.json with them
    local prof="${WIDE_PROFILE:-$OUT/h200.json}"
    [ -f "$prof" ] || { log "wide_probe: no profile"; return; }
    timeout 240 python3 scripts/probe_wide_fit.py --profile "$prof" -o "$OUT/h200.json" 2>>"$OUT/device.log" | tee -a "$OUT/device.log"
}
stage_placements() {  # the placements the side-by-side stages ran, as one file
    tar -C /tmp/wb_placements -czf "$OUT/placements.tar.gz" . && log "placements: $(tar -tzf "$OUT/placements.tar.gz" | grep -c json) files"
}
stage_calibrate() {  # the profile the later stages predict with ($OUT/h200.json)
    if [ -n "$build_pid" ]; then log "calibrate waits for the llama-bench build (it takes every core)"; wait_build; fi
    local kq=q4_k; [ -n "${BENCH_HYBRID_WEIGHTS:-}" ] && [ "$BENCH_HYBRID_WEIGHTS" != q4_k ] && kq="q4_k,$BENCH_HYBRID_WEIGHTS"
    kq="${BENCH_CALIBRATE_KQUANTS:-$kq}"  # e.g. q4_k,mxfp4 before stage engine_gpt_oss
    log "calibrate"; python3 -m workbench -v calibrate -o "$OUT/h200.json" --kquants "$kq" --kept-fits "${BENCH_KEPT_FITS:-q8_0,q4_k}" \
        2>>"$OUT/device.log" | tail -4 | tee -a "$OUT/device.log"
}
stage_keep() {  # the profile and llama-bench kept in /tmp/wb_keep for the next call on this warm machine; also
    # the parts of a carried pack (.llamacpp/pack), so that a pack too large to carry beside the tree (64 MiB a call)
    # can come in two calls: the first carries some parts and keeps them, the next carries the rest and restores them
    mkdir -p /tmp/wb_keep/bin /tmp/wb_keep/pack
    [ -f "$OUT/h200.json" ] && cp "$OUT/h200.json" /tmp/wb_keep/ && log "kept the profile"
    if ls .llamacpp/pack/llama-bench.tar.xz.part-* >/dev/null 2>&1; then
        cp .llamacpp/pack/llama-bench.tar.xz.part-* /tmp/wb_keep/pack/ && log "kept $(ls /tmp/wb_keep/pack | wc -l) pack parts"
    fi
    [ -x .llamacpp/bin/llama-bench ] || [ -n "$build_pid" ] || return 0
    wait_build && cp .llamacpp/bin/llama-bench /tmp/wb_keep/bin/ && log "kept llama-bench"
}
stage_restore() {  # what stage keep left on this machine: the profile as $OUT/h200.json, llama-bench, pack parts
    [ -f /tmp/wb_keep/h200.json ] && cp /tmp/wb_keep/h200.json "$OUT/" && log "profile restored"
    if [ ! -x .llamacpp/bin/llama-bench ] && [ -x /tmp/wb_keep/bin/llama-bench ]; then
        mkdir -p .llamacpp/bin && cp /tmp/wb_keep/bin/llama-bench .llamacpp/bin/ && log "llama-bench restored"
    fi
    if ls /tmp/wb_keep/pack/llama-bench.tar.xz.part-* >/dev/null 2>&1; then  # then stage build unpacks them
        mkdir -p .llamacpp/pack && cp -n /tmp/wb_keep/pack/* .llamacpp/pack/ && log "pack parts restored: $(ls .llamacpp/pack | wc -l)"
    fi
}
stage_cache_out() {  # Triton's compiled kernels (~/.triton/cache) and the fused CPU kernel's build as
    # $OUT/compile_cache.tar.xz, for the next call to carry as .compile_cache/ (a fresh machine compiled for ~200 s of
    # a calibration: BENCHMARKS.md, fifteenth stop); skipped above the 16 MiB a returned file may have
    local dirs=() f="$OUT/compile_cache.tar.xz"
    for d in .triton/cache .cache/moe-workbench/torch_ext; do [ -d "$HOME/$d" ] && dirs+=("$d"); done
    [ ${#dirs[@]} -gt 0 ] || { log "cache_out: nothing compiled"; return; }
    tar -C "$HOME" -cJf "$f" "${dirs[@]}"
    local mb=$(( $(stat -c %s "$f") / 1048576 ))
    if [ "$mb" -ge 16 ]; then rm -f "$f"; log "cache_out: ${mb} MiB, over what comes back; not returned"
    else log "cache_out: ${dirs[*]} in ${mb} MiB"; fi
}
stage_engine() {  # S1 skewed: llama.cpp and ours, with all on the GPU too
    if [ -f "$models/s1.gguf" ]; then  # a stage before may have left it uniform
        wb reskew "$models/s1.gguf" --coverage 0.5 | tee -a "$OUT/device.log"
    else
        log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5
    fi
    local all=(); [ "${BENCH_ALL_GPU:-1}" = 1 ] && all=(--all-gpu)
    side_by_side "$models/s1.gguf" "S1 bf16 skewed" engine_s1_skew.json n-cpu-moe,frequency,balanced "${all[@]}"
}
stage_pdl_tests() {  # test_decode_in_place on CUDA under each of PDL_AB's settings PDL:DENSE; full output in $OUT/pdl_tests.txt
    for v in ${PDL_AB:-0:0 0:1 1:0 1:auto}; do
        echo "=== WORKBENCH_PDL=${v%%:*} WORKBENCH_DENSE_MATVEC=${v##*:}" >>"$OUT/pdl_tests.txt"
        WORKBENCH_PDL=${v%%:*} WORKBENCH_DENSE_MATVEC=${v##*:} WORKBENCH_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q \
            -p no:cacheprovider tests/engine/test_decode_in_place.py >>"$OUT/pdl_tests.txt" 2>&1
        log "decode_in_place PDL ${v%%:*} dense ${v##*:}: rc $? $(tail -1 "$OUT/pdl_tests.txt")"
    done
}
stage_pdl_ab() {  # S1 bf16 skewed all on the GPU (and PDL_STRATEGIES at the budget) under each of PDL_AB's
    # settings PDL:DENSE (WORKBENCH_PDL, WORKBENCH_DENSE_MATVEC): kernels launched plainly, then with programmatic dependent launch
    [ -f "$models/s1.gguf" ] || { log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5; }
    local prof=bench-h200; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    for v in ${PDL_AB:-0:auto 1:0 1:auto}; do  # PDL is on where the GPU has it unless WORKBENCH_PDL=0
        log "PDL ${v%%:*} dense matvec ${v##*:}"
        WORKBENCH_PDL=${v%%:*} WORKBENCH_DENSE_MATVEC=${v##*:} wb run --model "$models/s1.gguf" --budget "${BENCH_BUDGET:-12GiB}" \
            --margin "${BENCH_MARGIN:-512MiB}" --profile "$prof" --strategies "${PDL_STRATEGIES:-}" --all-gpu -p 512 \
            -n "${BENCH_ENGINE_GEN:-64}" -r "${BENCH_ENGINE_REPEATS:-3}" --json "$OUT/pdl_ab_${v/:/_}.json" | tee -a "$OUT/device.log"
    done
}
stage_bus_ab() {  # decode's bus share balanced by the calibrated rates against the fixed 0.45 (WORKBENCH_BUS_SHARE):
    # S1 bf16 n-cpu-moe and frequency under each, after stage calibrate (its $OUT/h200.json has bus_read_rate); $OUT/bus_<v>.json
    [ -f "$models/s1.gguf" ] || { log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5; }
    local prof=bench-h200 v; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    for v in balanced ${BUS_AB_SHARES:-0.45}; do
        [ "$(left)" -gt 60 ] || { log "bus_ab: no time left for $v"; break; }
        log "bus_ab: $v"
        env $([ "$v" = balanced ] || echo WORKBENCH_BUS_SHARE=$v) python3 -m workbench bench run --model "$models/s1.gguf" \
            --budget "${BENCH_BUDGET:-12GiB}" --margin "${BENCH_MARGIN:-512MiB}" --profile "$prof" --strategies n-cpu-moe,frequency \
            -p 512 -n "${BENCH_ENGINE_GEN:-64}" -r "${BENCH_ENGINE_REPEATS:-2}" --time-limit $(( $(left) - 20 )) \
            --json "$OUT/bus_$v.json" 2>>"$OUT/device.log" | grep -E "^\| (n-cpu|freq)" | tee -a "$OUT/device.log"
    done
}
stage_env_ab() {  # S1 bf16 skewed all on the GPU under each of ENV_AB's settings (space-separated; each
    # VAR=VALUE[,VAR=VALUE...], e.g. "WORKBENCH_PDL=0 WORKBENCH_OUT_NORM=1,WORKBENCH_FUSED_ROUTING=1"): $OUT/ab_<n>.json;
    # AB_STRATEGIES (e.g. frequency,balanced): those placements at the budget instead of all on the GPU
    [ -f "$models/s1.gguf" ] || { log "writing S1 skewed"; wb write -o "$models/s1.gguf" --shape s1 $layers --coverage 0.5; }
    local prof=bench-h200 n=0; [ -f "$OUT/h200.json" ] && prof="$OUT/h200.json"
    local runs=(--strategies "" --all-gpu); [ -n "${AB_STRATEGIES:-}" ] && runs=(--strategies "$AB_STRATEGIES")
    for v in ${ENV_AB:-WORKBENCH_PDL=0 WORKBENCH_PDL=1}; do n=$((n + 1))
        [ "$(left)" -gt 40 ] || { log "env_ab: no time left for $v"; break; }
        log "env_ab $n: $v"
        env ${v//,/ } python3 -m workbench bench run --model "$models/s1.gguf" --budget "${BENCH_BUDGET:-12GiB}" \
            --margin "${BENCH_MARGIN:-512MiB}" --profile "$prof" "${runs[@]}" -p 512 \
            -n "${BENCH_ENGINE_GEN:-64}" -r "${BENCH_ENGINE_REPEATS:-3}" --json "$OUT/ab_$n.json" 2>>"$OUT/device.log" \
            | grep -E "^\| [a-z]|tok/s" | tee -a "$OUT/device.log"
    done
}
stage_kernel_tests() {  # the fused CPU kernel's tests on this machine's CPU (no transformers needed)
    log "kernel tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cpu_kernel.py \
        tests/engine/test_cpu_kernel_prompt.py >"$OUT/kernel_tests.txt" 2>&1; log "kernel tests rc $?"
    tail -3 "$OUT/kernel_tests.txt" | tee -a "$OUT/device.log"
}
stage_engine_uniform() {  # the same file with uniform routing
    [ -f "$models/s1.gguf" ] || { log "writing S1"; wb write -o "$models/s1.gguf" --shape s1 $layers --uniform; }
    wb reskew "$models/s1.gguf" --uniform | tee -a "$OUT/device.log"
    side_by_side "$models/s1.gguf" "S1 bf16 uniform" engine_s1_uniform.json "n-cpu-moe,frequency"
}
stage_engine_q4() {  # S1 as Q4_K for both engines (ours keeps the experts' Q4_K blocks); it nearly fits in 12 GiB
    rm -f "$models"/s1.gguf
    log "writing S1 Q4_K"; wb write -o "$models/s1_q4.gguf" --shape s1 $layers --weights q4_k | tee -a "$OUT/device.log"
    LLAMA_N_CPU_MOE="${LLAMA_N_CPU_MOE:-0,2}" side_by_side "$models/s1_q4.gguf" "S1 Q4_K skewed" engine_s1_q4.json "n-cpu-moe,frequency"
    rm -f "$models"/s1_q4.gguf
}
stage_engine_q8() {  # S1 as Q8_0 for both engines (ours keeps the experts' Q8_0 blocks)
    rm -f "$models"/s1.gguf
    log "writing S1 Q8_0"; wb write -o "$models/s1_q8.gguf" --shape s1 $layers --weights q8_0 | tee -a "$OUT/device.log"
    LLAMA_N_CPU_MOE="${LLAMA_N_CPU_MOE:-8}" side_by_side "$models/s1_q8.gguf" "S1 Q8_0 skewed" engine_s1_q8.json "n-cpu-moe,frequency,balanced"
    rm -f "$models"/s1_q8.gguf
}

{
    date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    lscpu | grep -E 'Model name|^CPU\(s\)|L3|Flags' | cut -c1-200; free -g; df -h /dev/shm | tail -1
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    git log -1 --format='commit %H' 2>/dev/null || true
} >>"$OUT/device.log" 2>&1
for st in "$@"; do
    log "stage $st"
    "stage_$st"
done
wait_build >/dev/null 2>&1 || true
log "done"
