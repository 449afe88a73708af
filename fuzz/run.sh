#!/usr/bin/env bash
# The native parsers under libFuzzer with AddressSanitizer and UndefinedBehaviorSanitizer
# (issue 32): builds each target in fuzz/ and runs it for a bounded time on a seed corpus
# generated from the engines' batch shapes (fuzz/make_corpus.py). Exits non-zero when a
# target crashes, leaks, hits undefined behaviour or spends over TIMEOUT s on one input
# (a quadratic path); the input that did it is kept in $OUT/crashes.
#
#   bash fuzz/run.sh                    # every target, FUZZ_SECONDS (45) each
#   FUZZ_SECONDS=600 bash fuzz/run.sh events
#
# CI runs it on a fresh machine: it installs clang and libFuzzer's runtime with apt-get
# when no clang++ with -fsanitize=fuzzer is found.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-45}
timeout=${FUZZ_TIMEOUT:-5}
# a fixed seed makes CI's run the same sequence of inputs every time (FUZZ_SEED=0: random),
# so a red run is reproducible and a green one is not luck
seed=${FUZZ_SEED:-1}
out=${FUZZ_OUT:-$(mktemp -d)}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(events nats)

fuzzer_cxx() {
    local probe
    probe=$(mktemp -d)
    echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
        >"$probe/t.cpp"
    for cxx in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
        if command -v "$cxx" >/dev/null &&
            "$cxx" -fsanitize=fuzzer "$probe/t.cpp" -o "$probe/t" 2>/dev/null; then
            rm -rf "$probe"
            echo "$cxx"
            return 0
        fi
    done
    rm -rf "$probe"
    return 1
}

if ! cxx=$(fuzzer_cxx); then
    echo "fuzz: installing clang and libFuzzer (apt-get)" >&2
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo=sudo
    $sudo apt-get update -q
    # Debian names the sanitizer runtimes libclang-rt-<N>-dev (12+); older ones ship them in clang
    version=$(apt-cache policy clang | sed -n 's/.*Candidate: [0-9]*:\{0,1\}\([0-9]*\).*/\1/p')
    $sudo apt-get install -y -q clang "libclang-rt-${version}-dev" ||
        $sudo apt-get install -y -q clang
    cxx=$(fuzzer_cxx) || { echo "fuzz: no clang++ with -fsanitize=fuzzer" >&2; exit 1; }
fi

python3 fuzz/make_corpus.py "$out/seeds"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
status=0
for t in "${targets[@]}"; do
    bin="$out/fuzz_$t"
    "$cxx" -std=c++17 -g -O1 -fno-omit-frame-pointer \
        -fsanitize=address,undefined,fuzzer -fno-sanitize-recover=all \
        "fuzz/fuzz_$t.cpp" -o "$bin"
    mkdir -p "$out/corpus_$t" "$out/crashes"
    echo "fuzz: $t for ${seconds}s" >&2
    if ! "$bin" "$out/corpus_$t" "$out/seeds/$t" -max_total_time="$seconds" -timeout="$timeout" \
        -seed="$seed" \
        -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$out/crashes/$t-" 2>"$out/$t.log"; then
        echo "fuzz: $t FAILED; its log: $out/$t.log, the input: $out/crashes/" >&2
        grep -E "ERROR|runtime error|SUMMARY|Test unit written" "$out/$t.log" >&2 || true
        status=1
    else
        grep -E "stat::number_of_executed_units|cov:" "$out/$t.log" | tail -2 >&2
    fi
done
exit $status
