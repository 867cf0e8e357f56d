#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz + libFuzzer) of the two decoders that read bytes from
# outside the process: `native_frame` (native frames: FrameReader -> header -> rkyv payload ->
# decode_request) and `lmcache_request` (LMCache msgpack: parse_op -> decode_request). The
# harnesses and the invariants they check live in src/fuzzing.rs; tests/fuzz_corpus.rs replays
# the committed corpus and regressions on every `cargo test`.
#
# Usage: scripts/fuzz.sh --seconds N [--target NAME] [--asan] [-- LIBFUZZER_ARGS...]
#   --seconds N    run each target for N seconds (required)
#   --target NAME  only this target (default: every target, one after the other)
#   --asan         also build with AddressSanitizer (needs RUSTC_BOOTSTRAP=1, see below)
# Output: one line per target:
#   fuzz: target=NAME seconds=N executions=E exec_per_s=R crashes=C corpus=F
# Exits non-zero on any crash (or if a run fails without one); crash inputs are in
# fuzz/artifacts/NAME/ (reproduce: cargo fuzz run -s none -a NAME FILE; minimise: cargo fuzz
# tmin -s none -a NAME FILE; then commit the minimised input under fuzz/regressions/NAME/).
#
# Stable toolchain: cargo-fuzz only needs nightly for the sanitizer flag (-Zsanitizer=...).
# Its coverage instrumentation (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*) and
# `--cfg fuzzing` are stable rustc options, and libFuzzer itself is C++ built by libfuzzer-sys
# with the system compiler. So `--sanitizer none` (-s none) builds on plain stable with no
# bootstrap override. The decoders are safe Rust (no `unsafe` in src/), so without a sanitizer
# a memory error could only come from a dependency's unsafe code (rkyv's validated access);
# `--asan` covers that by building with -Zsanitizer=address, which stable rustc accepts only
# with RUSTC_BOOTSTRAP=1 (the ASan runtime ships with the stable standard library). ASan costs
# a separate ~8-minute build and roughly half the throughput. Debug assertions (-a: overflow
# checks, slice and rkyv debug checks) are always on, so arithmetic overflow panics instead of
# wrapping silently.
#
# The corpus a run grows goes to fuzz/work/NAME/corpus (git-ignored); fuzz/corpus/NAME (seeds
# plus a minimised subset) is only read. To refresh the committed subset, merge the grown corpus
# into a copy of the committed one; set-cover merge on edges alone adds the fewest inputs that
# keep every edge the grown corpus reaches:
#   cp -r fuzz/corpus/NAME /tmp/m
#   cargo fuzz run -s none -a NAME /tmp/m fuzz/work/NAME/corpus -- -set_cover_merge=1 -use_counters=0
# then replace fuzz/corpus/NAME with /tmp/m.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

SECONDS_PER_TARGET=""
TARGETS=()
ASAN=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_PER_TARGET=${2:?--seconds needs a value}; shift 2 ;;
    --target) TARGETS+=("${2:?--target needs a value}"); shift 2 ;;
    --asan) ASAN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]] || { echo "usage: $0 --seconds N [--target NAME] [--asan]" >&2; exit 2; }
ALL_TARGETS=(native_frame lmcache_request remote_handshake remote_descriptors)
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL_TARGETS[@]}")
for t in "${TARGETS[@]}"; do
  [ -f "fuzz/fuzz_targets/$t.rs" ] || { echo "unknown target $t (have: ${ALL_TARGETS[*]})" >&2; exit 2; }
done

command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked

# -s none: no sanitizer, plain stable (see above). -a: debug assertions on.
FLAGS=(-s none -a)
if [ "$ASAN" = 1 ]; then
  export RUSTC_BOOTSTRAP=1
  # A build directory of its own, so switching modes does not rebuild the other one.
  FLAGS=(-s address -a --target-dir "${CARGO_TARGET_DIR:-fuzz/target}/asan")
fi

for t in "${TARGETS[@]}"; do
  mkdir -p "fuzz/work/$t"
  if ! nice -n 10 cargo fuzz build "${FLAGS[@]}" "$t" >"fuzz/work/$t/build.log" 2>&1; then
    cat "fuzz/work/$t/build.log" >&2
    echo "fuzz: build of $t failed" >&2
    exit 1
  fi
done

failed=0
for t in "${TARGETS[@]}"; do
  work="fuzz/work/$t"
  mkdir -p "$work/corpus" "fuzz/artifacts/$t"
  log="$work/fuzz.log"
  stamp="$work/.started"
  touch "$stamp"
  dict=()
  [ -f "fuzz/$t.dict" ] && dict=("-dict=fuzz/$t.dict")
  # The grown corpus goes to the first directory; the committed one is only read.
  set +e
  nice -n 10 cargo fuzz run "${FLAGS[@]}" "$t" "$work/corpus" "fuzz/corpus/$t" -- \
    -max_total_time="$SECONDS_PER_TARGET" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
    "${dict[@]}" "${EXTRA[@]}" >"$log" 2>&1
  rc=$?
  set -e
  # Crash inputs libFuzzer saved during this run (crash-, timeout-, oom-, leak-).
  new_crashes=$(find "fuzz/artifacts/$t" -maxdepth 1 -type f -newer "$stamp" \
    \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \))
  crashes=$(printf '%s' "$new_crashes" | grep -c . || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  if [ -z "$execs" ]; then # no final stats (killed): the last status line's counter
    execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  fi
  rate=$(sed -n 's/^stat::average_exec_per_sec: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  corpus=$(find "$work/corpus" -type f | wc -l)
  echo "fuzz: target=$t seconds=$SECONDS_PER_TARGET executions=${execs:-0} exec_per_s=${rate:-0} crashes=$crashes corpus=$corpus log=$log"
  if [ "$crashes" -gt 0 ]; then
    failed=1
    printf '%s\n' "$new_crashes" | sed 's/^/  crash input: /'
    grep -m1 -A3 -E "panicked at|ERROR: libFuzzer|==ERROR" "$log" | sed 's/^/  /' || true
  elif [ "$rc" -ne 0 ]; then
    failed=1
    echo "  fuzz run failed (exit $rc) without a crash input; see $log" >&2
    tail -5 "$log" | sed 's/^/  /' >&2
  fi
done
exit "$failed"
