#!/usr/bin/env bash
# Where a decode's time goes, kernel by kernel (GPU machine, with gpu-bin): Nsight Compute
# times every mla_ kernel of one replayed decode (the scheduler, stage 1, the combine) without
# touching clocks or caches, and prints one line a kernel: name, grid, duration (us).
#   scripts/gpu/kernel_times.sh ["bench-args; ..."]   e.g. "64 128 8192 --varlen --schedule"
# Each case's bench runs with --iters 1; its first nine mla_ launches are profiled (the checked
# decode, then the first graph replays: three decodes of the scheduled path, more of the split
# grid) and printed in order.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/ncu_setup.sh
. scripts/gpu/ncu_setup.sh
IFS=';' read -ra cases <<< "${1:-64 128 8192 --varlen --schedule}"
for c in "${cases[@]}"; do
  read -r b h ctx extra <<< "$c"
  # shellcheck disable=SC2086  # extra is a list of arguments
  timeout 150 ncu --clock-control none --cache-control none --kernel-name "regex:mla_" \
    --launch-count 9 --print-units base \
    --metrics gpu__time_duration.sum,launch__grid_size --csv gpu-bin/mla bench --backend cuda \
    --batch "$b" --heads "$h" --ctx "$ctx" --page 64 --iters 1 $extra > "$out/kt.csv" 2> "$out/kt.err"
  echo "== $c (rc=$?)"
  python3 - "$out/kt.csv" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
ix = {k: i for i, k in enumerate(head)}
by = {}
for r in body:
    key = (r[ix["ID"]], r[ix["Kernel Name"]])
    by.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
launches = [(k[1], m) for k, m in sorted(by.items(), key=lambda kv: int(kv[0][0]))]
for name, m in launches:
    us = float(m.get("gpu__time_duration.sum", "nan").replace(",", "")) / 1e3  # ns
    print(f"  {name[:48]:48s} grid {m.get('launch__grid_size', '?'):>6s}  {us:8.1f} us")
EOF
done
