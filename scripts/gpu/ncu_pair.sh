#!/usr/bin/env bash
# Nsight Compute on our stage-1 kernel and FlashMLA's dense decode on the same case (GPU
# machine, with gpu-bin and .anchors): each one's duration, warp-state stalls and
# per-SASS-instruction counts (executed instructions, stall samples) into ncu_pair.tgz in the
# results folder (ncu_setup.sh; the reports, their details pages and the per-instruction
# CSVs).
#   scripts/gpu/ncu_pair.sh "FAMILY B H CTX [--vary]; ..."   (FAMILY: `mla bench --kernel`'s
#   seesaw, wgmma, mma, narrow, wgmma-fp8)
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/ncu_setup.sh
. scripts/gpu/ncu_setup.sh
sections=(--section WarpStateStats --section SourceCounters --section LaunchStats --section SpeedOfLight)
IFS=';' read -ra cases <<< "${1:-seesaw 66 128 4096}"
i=0
for c in "${cases[@]}"; do
  read -r kernel b h ctx vary <<< "$c"
  i=$((i + 1))
  entry=mla_decode_${kernel//-/_}
  [ "$kernel" = mma ] && entry=mla_decode_split
  # ours: the bench's third launch of the kernel (the first two warm the cache and the graph)
  timeout 150 ncu --clock-control none --cache-control none \
    --kernel-name "regex:$entry" --launch-skip 2 --launch-count 1 "${sections[@]}" \
    --import-source no -o "$out/ours$i" gpu-bin/mla bench --backend cuda --kernel "$kernel" \
    --batch "$b" --heads "$h" --ctx "$ctx" --page 64 --iters 1 ${vary:+--varlen} > "$out/ours$i.log" 2>&1
  echo "== ours $i ($entry): $b x $h x $ctx $vary rc=$?"
  timeout 150 ncu --clock-control none --cache-control none --kernel-name "regex:flash_fwd_splitkv_mla" \
    --launch-skip 2 --launch-count 1 "${sections[@]}" --import-source no -o "$out/fm$i" \
    env PYTHONPATH=scripts/gpu python3 scripts/gpu/ncu_flashmla.py --ref .anchors "$b" "$h" "$ctx" \
    ${vary:+--vary} > "$out/fm$i.log" 2>&1
  echo "== flashmla $i: $b x $h x $ctx $vary rc=$?"
  for r in "ours$i" "fm$i"; do
    [ -f "$out/$r.ncu-rep" ] || { tail -n 5 "$out/$r.log"; continue; }
    ncu -i "$out/$r.ncu-rep" --page details > "$out/$r.txt" 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Executed Ipc A|No Eligible|Registers Per" "$out/$r.txt" | head -n 8
    ncu -i "$out/$r.ncu-rep" --page source --print-source sass --csv > "$out/$r.sass.csv" 2>&1
  done
done
tar czf "$final/ncu_pair.tgz" -C "$out" .
