#!/usr/bin/env bash
# Two builds of the CLI on the GPU machine, case by case (scripts/gpu/before_after.py: one
# `mla bench` a case and a build, the builds alternating): a table of old us, new us and
# old/new. Both build folders go to the GPU machine (scripts/gpu/build.sh makes gpu-bin;
# scripts/gpu/build_branch.sh REV NAME --lean makes gpu-bin-NAME; .gitignore ignores gpu-bin*).
#   scripts/gpu/ab.sh BEFORE_DIR AFTER_DIR ["B H CTX KV [more bench arguments]; ..."]
# Without cases, the anchors' grid. AB_ARGS_A / AB_ARGS_B: `mla bench` arguments for one side
# only, e.g. a family forced against the shipped choice on the same build:
#   AB_ARGS_B="--kernel wgmma-fp8" scripts/gpu/ab.sh gpu-bin gpu-bin "64 128 8192 fp8"
set -uo pipefail
cd "$(dirname "$0")/../.."
a=$1 b=$2
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
# Each build's cubins compiled by build.sh (run.sh does the same).
for dir in "$a" "$b"; do
  if [ -d "$dir/cache" ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn "$dir/cache/." "$MLA_CACHE_DIR"/; fi
done
python3 scripts/gpu/before_after.py --before "$a" --after "$b" --cases "${3:-}" \
  --args-before "${AB_ARGS_A:-}" --args-after "${AB_ARGS_B:-}"
