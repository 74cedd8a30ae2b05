#!/usr/bin/env bash
# llama.cpp's llama-bench, for side-by-side benchmarks (docs: BENCHMARKS.md).
#
#   scripts/build_llamacpp.sh fetch   # here (needs PyPI): llama-cpp-python sdist -> .llamacpp/llama.cpp,
#                                     # pruned to what llama-bench needs (a few MiB, carried to the device)
#   scripts/build_llamacpp.sh build   # on the GPU machine: CUDA build for sm_90 -> .llamacpp/bin/llama-bench
#   scripts/build_llamacpp.sh cpu     # here: CPU-only build (checks that our GGUF files load)
#   scripts/build_llamacpp.sh ggml-pack  # here: ggml's CPU sources -> .llamacpp/ggml-src.tar.xz (~1 MiB, carried)
#   scripts/build_llamacpp.sh ggml-cpu   # anywhere: ggml's CPU backend alone, static, -> .llamacpp/build-ggml
#                                        # (for scripts/time_cpu_vs_ggml.py; unpacks ggml-src.tar.xz if needed;
#                                        # GGML_AVX2_ONLY=1: its AVX2 code -> .llamacpp/build-ggml-avx2)
#
# LLAMA_JOBS (default: nproc) sets the parallel jobs. .llamacpp/ must be ignored by git
# (.git/info/exclude holds "/.llamacpp/").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.llamacpp"
src="$dest/llama.cpp"
mode="${1:-}"
jobs="${LLAMA_JOBS:-$(nproc)}"

fetch() {
    local tmp
    tmp="$(mktemp -d)"
    python3 -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    local up
    up="$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)"
    rm -rf "$src"
    mkdir -p "$src/tools" "$src/ggml/src"
    (cd "$up" && git log -1 --format=%H 2>/dev/null || true) >"$dest/COMMIT"
    basename "$(ls "$tmp"/llama_cpp_python-*.tar.gz)" >"$dest/SDIST"
    for d in CMakeLists.txt cmake common include src vendor LICENSE licenses; do
        cp -r "$up/$d" "$src/$d"
    done
    cp -r "$up/tools/llama-bench" "$src/tools/"
    printf 'llama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' >"$src/tools/CMakeLists.txt"
    cp "$up/ggml/CMakeLists.txt" "$src/ggml/"
    cp -r "$up/ggml/cmake" "$up/ggml/include" "$src/ggml/"
    for f in "$up"/ggml/src/*; do
        case "$(basename "$f")" in
            ggml-*) [ -d "$f" ] || cp "$f" "$src/ggml/src/" ;;
            *) cp -r "$f" "$src/ggml/src/" ;;
        esac
    done
    cp -r "$up/ggml/src/ggml-cpu" "$up/ggml/src/ggml-cuda" "$src/ggml/src/"
    rm -rf "$src/vendor/miniaudio"/*.c 2>/dev/null || true
    rm -rf "$tmp"
    du -sh "$src"
}

configure() {  # $1 build dir, then extra cmake args
    local build="$1"; shift
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON "$@"
}

case "$mode" in
    fetch) fetch ;;
    build)
        start=$(date +%s)
        configure "$dest/build-cuda" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
            -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF
        cmake --build "$dest/build-cuda" --target llama-bench -j "$jobs"
        mkdir -p "$dest/bin"
        cp "$dest/build-cuda/bin/llama-bench" "$dest/bin/llama-bench"
        echo "llama-bench (CUDA) built in $(( $(date +%s) - start )) s"
        ;;
    cpu)
        configure "$dest/build-cpu"
        cmake --build "$dest/build-cpu" --target llama-bench -j "$jobs"
        mkdir -p "$dest/bin-cpu"
        cp "$dest/build-cpu/bin/llama-bench" "$dest/bin-cpu/llama-bench"
        ;;
    ggml-pack)
        tar -C "$src" --exclude=ggml/src/ggml-cuda -cJf "$dest/ggml-src.tar.xz" ggml
        du -h "$dest/ggml-src.tar.xz"
        ;;
    ggml-cpu)
        if [ ! -f "$src/ggml/CMakeLists.txt" ]; then
            mkdir -p "$src" && tar -C "$src" -xJf "$dest/ggml-src.tar.xz"
        fi
        [ -f "$src/ggml/ggml.pc.in" ] || : >"$src/ggml/ggml.pc.in"  # pkg-config template, pruned by fetch
        gen=()
        command -v ninja >/dev/null && gen=(-G Ninja)
        out="$dest/build-ggml" isa=(-DGGML_NATIVE=ON)
        if [ "${GGML_AVX2_ONLY:-0}" = 1 ]; then  # the AVX2 code of a CPU without AVX-512, -> build-ggml-avx2
            out="$dest/build-ggml-avx2"
            isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
        fi
        cmake -S "$src/ggml" -B "$out" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            "${isa[@]}" -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF >/dev/null
        cmake --build "$out" --target ggml-cpu ggml-base -j "$jobs"
        ;;
    *) echo "usage: $0 fetch|build|cpu|ggml-pack|ggml-cpu" >&2; exit 2 ;;
esac
