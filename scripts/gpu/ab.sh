#!/usr/bin/env bash
# A/B of two builds of the CLI on the GPU machine: `mla bench` on each case, the builds
# alternating (A B A B), one line a run. Carry both build folders (scripts/gpu/build.sh makes
# gpu-bin; move an older one aside first, e.g. to gpu-bin-old: .gitignore ignores gpu-bin*).
#   scripts/gpu/ab.sh A_DIR B_DIR ["b h ctx [more bench arguments]; ..."]
# AB_DEFINES_A / AB_DEFINES_B: MLA_EXTRA_DEFINES for each side (an experiment switch against
# the same build: scripts/gpu/ab.sh gpu-bin gpu-bin with AB_DEFINES_B="-DMLA_CP_L2=128");
# AB_KERNEL_A / AB_KERNEL_B: MLA_KERNEL for each side (a family forced against the shipped
# choice: AB_KERNEL_B=wgmma_fp8).
set -uo pipefail
cd "$(dirname "$0")/../.."
a=$1 b=$2
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
# Each build's cubins compiled by build.sh (run.sh does the same).
for dir in "$a" "$b"; do
  if [ -d "$dir/cache" ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn "$dir/cache/." "$MLA_CACHE_DIR"/; fi
done
IFS=';' read -ra cases <<< "${3:-1 16 8192; 1 16 1024; 1 128 8192; 8 16 4096; 4 16 32768; 8 128 4096; 64 16 8192}"
for c in "${cases[@]}"; do
  read -r bs h ctx extra <<< "$c"
  for side in A B A B; do
    if [ "$side" = A ]; then dir=$a defs=${AB_DEFINES_A:-} kernel=${AB_KERNEL_A:-}
    else dir=$b defs=${AB_DEFINES_B:-} kernel=${AB_KERNEL_B:-}; fi
    # shellcheck disable=SC2086  # extra is a list of arguments
    r=$(MLA_KERNEL=$kernel MLA_EXTRA_DEFINES=$defs timeout 60 "$dir/mla" bench --backend cuda --batch "$bs" --heads "$h" --ctx "$ctx" --page 64 \
      --iters 10 --json $extra 2>/dev/null | tail -n 1)
    echo "$side $dir${defs:+ ($defs)}${kernel:+ (MLA_KERNEL=$kernel)} $bs $h $ctx ${extra:-} $(echo "$r" | python3 -c 'import json, sys
r = json.load(sys.stdin)
print("%.1f us err %.1e splits %d %s" % (r["us"], r["err_o"], r["num_kv_splits"], r.get("kernel", "")))' 2>/dev/null || echo failed)"
  done
done
