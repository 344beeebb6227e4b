#!/usr/bin/env bash
# The GPU checks and benchmarks. Build on a CPU machine with scripts/gpu/build.sh (it makes
# gpu-bin/: the release CLI, the GPU test binaries, the sm_90a cubins and the mla_rs wheel),
# copy gpu-bin/ (and .anchors/, for the side-by-side benchmarks; and an older build such as
# gpu-bin-main, for a before/after) to the GPU machine's copy of this repository, and run
# there, from the repository root:
#   scripts/gpu/run.sh [STEP ...]       (default: all)
# Steps:
#   tests      every GPU suite binary once, with MLA_REQUIRE_GPU=1 (a GPU that cannot be
#              opened fails them); each binary runs its suites once per kernel setting
#              (as shipped, each family forced, the device schedule) and prints one line a
#              setting: how many cases its family really ran.
#   memcheck, racecheck
#              compute-sanitizer on cuda_sanitize, one process per kernel setting
#              (`--exact sanitize::forced_seesaw`, ...), side by side.
#   pytest     the mla_rs suite.
#   bench      `mla bench`'s default grid.
#   compare, narrow, schedule, cases, pdl, sweep
#              `mla bench` tables: families (`--kernel`), the device schedule (`--schedule`),
#              chosen cases, programmatic dependent launch (`--no-pdl`), split counts.
#   profile    Nsight Compute on one decode.
#   dcp        the two-GPU DCP test and `mla bench --dcp 2` (needs two GPUs).
#   mtp, fp8q  side by side with the anchors: multi-token rows, the fp8 paths.
#   anchors    side by side with the anchors (.anchors/anchors.py), then, where MLA_BEFORE
#              names an older build's folder (default gpu-bin-main, when present), the
#              anchors' grid on both builds' CLIs: a before/after table.
# `all` is tests, memcheck, racecheck, pytest, bench and anchors. Every log goes into $OUT
# (./results when unset) as logs.tgz; the last lines printed are a summary. Each step runs
# under a time limit (seconds, MLA_STEP_LIMIT, default 300).
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-results}
out=$(mktemp -d)  # the logs, packed into $final/logs.tgz at the end
mkdir -p "$final"
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
export MLA_REQUIRE_GPU=1
before=${MLA_BEFORE:-gpu-bin-main}
# The sm_90a cubins build.sh compiled (same NVRTC, same cache names): a fresh machine then
# loads them instead of spending a minute compiling.
for dir in gpu-bin "$before"; do
  if [ -d "$dir/cache" ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn "$dir/cache/." "$MLA_CACHE_DIR"/; fi
done
export RUST_BACKTRACE=1
steps=${*:-all}
summary=()
note() { summary+=("$1"); }

has() {
  [[ " $steps " == *" $1 "* ]] && return 0
  [[ " $steps " == *" all "* ]] && [[ " tests memcheck racecheck pytest bench anchors " == *" $1 "* ]]
}
limit=${MLA_STEP_LIMIT:-300}

# mla_rs, when its wheel was built: the anchors benchmark then runs it in-process.
if ls gpu-bin/wheels/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/mla-site gpu-bin/wheels/*.whl \
    && export PYTHONPATH=/tmp/mla-site${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv > "$out/gpu.txt" 2>&1
note "gpu: $(tail -n +2 "$out/gpu.txt" | head -n 1)"
gpu-bin/mla info > "$out/info.txt" 2>&1
gpu-bin/mla precompile > "$out/precompile.txt" 2>&1
note "precompile: $(tail -n 1 "$out/precompile.txt")"

# The kernel settings each suite binary runs (kernel_tests! in crates/mla/tests/common/gpu/kernels.rs).
settings="as_shipped forced_mma forced_wgmma forced_narrow forced_seesaw forced_wgmma_fp8
  device_schedule device_schedule_forced_mma device_schedule_forced_wgmma device_schedule_forced_seesaw"

# run_test NAME: one suite binary, every kernel setting; its result and each setting's tally.
run_test() {
  local t=$1 log="$out/test-$1.log" start rc
  start=$(date +%s)
  timeout "$limit" "gpu-bin/tests/$t" > "$log" 2>&1
  rc=$?
  note "tests $t: rc=$rc ($(( $(date +%s) - start ))s): $(grep -E '^test result' "$log" | tail -n 1)"
  while read -r line; do note "  $line"; done < <(grep -E "^$t, " "$log")
  if [ $rc -ne 0 ]; then
    grep -E -B2 -A12 "panicked|^---- " "$log" | cut -c1-400 | head -n 60
  fi
}
if has tests; then
  for t in cuda_contract cuda_runtime cuda_batch_invariance cuda_sanitize cuda_schedule cuda_nan errors; do run_test $t; done
  # The Hopper kernels must be built of warpgroup MMAs (HGMMA in the SASS).
  for f in $(find "$MLA_CACHE_DIR" -type f); do
    n=$(cuobjdump -sass "$f" 2>/dev/null | grep -c HGMMA)
    [ "${n:-0}" -gt 0 ] && echo "$(basename "$f"): $n HGMMA" >> "$out/sass.txt"
  done
  note "sass: $(wc -l < "$out/sass.txt" 2>/dev/null || echo 0) cubins with HGMMA"
fi

# Each sanitizer once per kernel setting, one process each (the runs are independent and
# mostly CPU-bound: they run side by side; MLA_SANITIZE_SERIAL=1: one at a time); each writes
# its summary line to a file, read back in order.
sanitize_one() {  # TOOL SETTING
  local tool=$1 k=$2 log="$out/sanitizer-$1-$2.log"
  timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    gpu-bin/tests/cuda_sanitize --exact "sanitize::$k" --test-threads=1 > "$log" 2>&1
  echo "compute-sanitizer $tool $k: rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$log" | tr '\n' ' ')" \
    > "$out/note-sanitizer-$tool-$k.txt"
}
runs=()
for tool in memcheck racecheck; do
  if has "$tool"; then for k in $settings; do runs+=("$tool:$k"); done; fi
done
for r in "${runs[@]}"; do
  if [ "${MLA_SANITIZE_SERIAL:-0}" = 1 ]; then sanitize_one "${r%%:*}" "${r#*:}"; else sanitize_one "${r%%:*}" "${r#*:}" & fi
done
wait
for r in "${runs[@]}"; do
  note "$(cat "$out/note-sanitizer-${r%%:*}-${r#*:}.txt" 2>/dev/null || echo "compute-sanitizer $r: no result")"
done

if has pytest; then
  timeout "$limit" python3 -m pytest -q -rs crates/mla-py/tests > "$out/pytest.log" 2>&1
  rc=$?
  note "pytest: rc=$rc: $(tail -n 1 "$out/pytest.log")"
  if [ $rc -ne 0 ]; then grep -E -A25 "^_+ test" "$out/pytest.log" | cut -c1-300 | head -n 80; fi
fi

if has bench; then
  timeout "$limit" gpu-bin/mla bench --backend cuda --iters 10 > "$out/bench.txt" 2>&1
  note "bench: rc=$? (bench.txt)"
fi

# bench_row LABEL LOG BENCH-ARGS...: one `mla bench --json` case, appended to $out/LOG.txt as
# "LABEL JSON" (the line compare_table.py reads); stderr to $out/LOG.err.
bench_row() {
  local label=$1 log=$2 r
  shift 2
  r=$(timeout "$limit" gpu-bin/mla bench --backend cuda --page 64 --iters 10 --json "$@" \
    2>> "$out/$log.err" < /dev/null | tail -n 1)
  echo "$label $r" >> "$out/$log.txt"
}

# table LOG LABELS: the cases read from stdin ("B H CTX KV [more bench arguments]"), each once per
# label of LABELS ("label=bench arguments" items, separated by ";"), then the table.
table() {
  local log=$1 labels b h c kv extra item
  IFS=';' read -ra labels <<< "$2"
  while read -r b h c kv extra; do
    [ -n "$b" ] || continue
    for item in "${labels[@]}"; do
      read -r item <<< "$item"  # trimmed
      # shellcheck disable=SC2086  # the label's and the case's extra arguments are lists
      bench_row "${item%%=*} $b $h $c $kv" "$log" --batch "$b" --heads "$h" --ctx "$c" \
        --kv-dtype "$kv" $extra ${item#*=}
    done
  done
  python3 scripts/gpu/compare_table.py "$out/$log.txt"
}

if has compare; then
  # The stage-1 families of MLA_COMPARE_KERNELS (default: mma wgmma) on the same problems,
  # those below or MLA_COMPARE_CASES ("b h ctx kv [more bench arguments]; ...").
  labels=""
  for k in ${MLA_COMPARE_KERNELS:-mma wgmma}; do labels+="$k=--kernel $k;"; done
  if [ -n "${MLA_COMPARE_CASES:-}" ]; then tr ';' '\n' <<< "$MLA_COMPARE_CASES"; else cat <<'CASES'
128 128 4096 bf16
32 128 8192 bf16
1 128 8192 bf16
64 64 4096 bf16
128 16 4096 bf16
128 128 4096 fp8
1 128 8192 fp8
64 32 4096 bf16
64 32 4096 fp8
64 128 4096 bf16 --query-len 2
64 16 8192 bf16 --query-len 4 --causal false
64 16 8192 bf16 --query-len 4
64 16 8192 bf16 --query-len 2
4 16 8192 bf16 --query-len 4
64 16 8192 fp8 --query-len 4
CASES
  fi | table compare "$labels"
fi

if has narrow; then
  # Few heads: the narrow kernel forced against the mma kernel, on the same problems.
  table narrow "narrow=--kernel narrow; mma=--kernel mma" <<'CASES'
128 16 4096 bf16
64 16 8192 bf16
32 16 8192 bf16
8 16 4096 bf16
4 16 32768 bf16
1 16 8192 bf16
1 16 1024 bf16
128 8 4096 bf16
64 8 8192 bf16 --query-len 2
128 16 4096 fp8
64 16 8192 fp8
8 16 4096 fp8
64 8 8192 fp8 --query-len 2
CASES
fi

if has schedule; then
  # The device-computed schedule against the fill rule's split grid, on the same problems
  # (varied lengths are what it is for).
  table schedule "grid=; schedule=--schedule" <<'CASES'
64 128 8192 bf16 --varlen
64 16 8192 bf16 --varlen
32 128 8192 bf16 --varlen
128 128 4096 bf16
32 128 4096 bf16
4 128 32768 bf16
8 128 4096 bf16
1 128 8192 bf16
128 16 4096 bf16
64 16 8192 bf16
8 16 4096 bf16
1 16 8192 bf16
64 128 8192 fp8 --varlen
CASES
fi

if has cases; then
  # Chosen cases as shipped (MLA_CASES: "b h ctx kv [more bench arguments]; ...").
  tr ';' '\n' <<< "${MLA_CASES:-64 16 8192 fp8; 64 16 8192 bf16; 128 128 2048 fp8; 128 128 2048 bf16}" |
    table cases "ours="
fi

if has pdl; then
  # The combine as a programmatic dependent launch (as shipped on sm_90a) against an ordinary
  # launch, on the small batches where its launch and latency show.
  table pdl "pdl=; nopdl=--no-pdl" <<'CASES'
1 16 8192 bf16
1 16 1024 bf16
1 128 8192 bf16
1 128 1024 bf16
8 128 4096 bf16
4 16 32768 bf16
CASES
fi

if has sweep; then
  # Split counts against the fill rule's choice (`mla bench --splits`), on the small batches
  # the rule decides. MLA_SWEEP_CASES ("b h ctx kv [more bench arguments]; ..."),
  # MLA_SWEEP_SPLITS replace the defaults; MLA_SWEEP_SCHEDULE=1 adds the device schedule.
  labels="rule="
  for n in ${MLA_SWEEP_SPLITS:-8 16 32 48 64 96 128}; do labels+="; splits$n=--splits $n"; done
  [ "${MLA_SWEEP_SCHEDULE:-0}" = 1 ] && labels+="; schedule=--schedule"
  tr ';' '\n' <<< "${MLA_SWEEP_CASES:-1 128 8192 bf16; 1 128 1024 bf16; 1 16 8192 bf16; 8 128 4096 bf16; 4 16 32768 bf16}" |
    table sweep "$labels"
fi

if has dcp; then
  n=$(nvidia-smi -L | wc -l)
  if [ "$n" -ge 2 ]; then
    timeout "$limit" gpu-bin/tests/dcp_gpu --test-threads=1 --nocapture > "$out/test-dcp_gpu.log" 2>&1
    note "tests dcp_gpu: rc=$?: $(grep -E '^test result' "$out/test-dcp_gpu.log" | tail -n 1)"
    grep -E "o_rel|lse" "$out/test-dcp_gpu.log" | head -n 12
    for args in "--batch 64 --ctx 131072 --heads 128" "--batch 8 --ctx 524288 --heads 16"; do
      # shellcheck disable=SC2086  # args is a list of arguments
      timeout "$limit" gpu-bin/mla bench --dcp 2 $args --iters 10 >> "$out/dcp-bench.txt" 2>&1
      note "dcp bench $args: rc=$?"
    done
    cat "$out/dcp-bench.txt"
  else
    note "dcp: skipped, $n GPU(s)"
  fi
fi

if has profile; then
  # Nsight Compute on one decode: by default the wgmma kernel (forced) on 64 requests x 4096
  # keys, 64 heads (one wave). MLA_PROFILE_KERNEL (a regex of entry points, e.g.
  # "mla_decode_(narrow|combine)"), MLA_PROFILE_COUNT (launches profiled) and
  # MLA_PROFILE_ARGS (`mla bench` arguments, `--kernel` among them) replace the defaults.
  # shellcheck disable=SC2086  # MLA_PROFILE_ARGS is a list of arguments
  timeout "$limit" ncu --clock-control none --kernel-name "regex:${MLA_PROFILE_KERNEL:-mla_decode_wgmma}" \
    --launch-count "${MLA_PROFILE_COUNT:-1}" \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    gpu-bin/mla bench --backend cuda \
    ${MLA_PROFILE_ARGS:---kernel wgmma --batch 64 --heads 64 --ctx 4096} --page 64 --kv-dtype bf16 --iters 1 \
    > "$out/ncu.txt" 2>&1
  note "profile: rc=$? (ncu.txt)"
  grep -E "Duration|Throughput|Pipe|Stall|Issued|Eligible|Active Warps|L2 Hit|Registers|Shared Memory Config" "$out/ncu.txt" | head -n 40
fi

if has mtp && [ -f .anchors/anchors.py ]; then
  # Multi-token (causal, 2 and 4 tokens a request) side by side with FlashMLA and FA3.
  PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/gpu/anchors_mtp.py --ref .anchors \
    --out "$out/anchors-mtp.json" > "$out/anchors-mtp.txt" 2>&1
  note "anchors mtp: rc=$? (anchors-mtp.txt)"
  tail -n 20 "$out/anchors-mtp.txt"
  cp "$out/anchors-mtp.json" "$final/" 2>/dev/null
fi

if has fp8q && [ -f .anchors/anchors.py ]; then
  # fp8 caches: FlashMLA's fp8 path against ours with a bf16 query and in the fp8-query mode.
  PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/gpu/anchors_fp8q.py --ref .anchors \
    --out "$out/anchors-fp8q.json" > "$out/anchors-fp8q.txt" 2>&1
  note "anchors fp8q: rc=$? (anchors-fp8q.txt)"
  tail -n 24 "$out/anchors-fp8q.txt"
  cp "$out/anchors-fp8q.json" "$final/" 2>/dev/null
fi

if has anchors; then
  if [ -f .anchors/anchors.py ]; then
    PYTHONUNBUFFERED=1 timeout "$limit" python3 .anchors/anchors.py --ref .anchors --out "$out/anchors.json" \
      --ours "gpu-bin/mla bench --backend cuda --iters 10" > "$out/anchors.txt" 2>&1
    note "anchors: rc=$? (anchors.txt)"
    tail -n 8 "$out/anchors.txt"
    cp "$out/anchors.json" "$final/" 2>/dev/null
  else
    note "anchors: no .anchors/anchors.py"
  fi
  if [ -x "$before/mla" ]; then
    # Ours before and after, on the anchors' grid, each build's CLI.
    PYTHONUNBUFFERED=1 timeout "$limit" python3 scripts/gpu/before_after.py --before "$before" \
      --after gpu-bin --out "$out/before-after.json" > "$out/before-after.txt" 2>&1
    note "before/after ($before -> gpu-bin): rc=$? (before-after.txt): $(tail -n 1 "$out/before-after.txt")"
    cat "$out/before-after.txt"
    cp "$out/before-after.json" "$final/" 2>/dev/null
  fi
fi

tar czf "$final/logs.tgz" -C "$out" .
echo
printf '%s\n' "${summary[@]}"
