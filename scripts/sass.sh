#!/usr/bin/env bash
# The SASS of our kernels, with no GPU and no CUDA toolkit: NVRTC 13.0 (scripts/ci/nvrtc.sh)
# compiles every variant for an architecture (`mla precompile --arch`), and nvdisasm from PyPI
# (a newer release reads 13.0's cubins) disassembles the ones whose cache name matches.
#   scripts/sass.sh [NAME_REGEX] [ARCH]      e.g. scripts/sass.sh 'mla_decode_combine' sm_90a
# Writes one .sass file per cubin into target/sass/ and prints, for each, its instruction count
# and most frequent opcodes; target/sass/precompile.txt has each cubin's defines and registers.
# What it is for: seeing whether loads meant to fly together are issued together, what a loop
# costs a trip, what an unroll or a define changed, before spending GPU time. Builds the CLI
# first (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
pattern=${1:-.}
arch=${2:-sm_90a}
tools=target/nvdisasm
nvdisasm="$tools/nvidia/cu13/bin/nvdisasm"
if [ ! -x "$nvdisasm" ]; then
  mkdir -p "$tools"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tools" "nvidia-cuda-nvdisasm==13.2.51" >&2
  python3 -c 'import sys, zipfile, glob; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[1] + "/*.whl")]' "$tools"
  chmod +x "$nvdisasm"
fi
cargo build --release -q -p mla-cli
cache=target/sass/cache
out=target/sass
rm -rf "$cache" && mkdir -p "$cache" && rm -f "$out"/*.sass
LD_LIBRARY_PATH=$(scripts/ci/nvrtc.sh) MLA_CACHE_DIR="$cache" target/release/mla precompile --arch "$arch" > "$out/precompile.txt"
for cubin in "$cache"/*.cubin; do
  name=$(basename "$cubin" .cubin)
  [[ "$name" =~ $pattern ]] || continue
  "$nvdisasm" -c "$cubin" > "$out/$name.sass"
  count=$(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$out/$name.sass" || true)
  top=$(grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+' "$out/$name.sass" \
    | awk '{print $NF}' | sort | uniq -c | sort -rn | head -n 6 | awk '{printf "%s %s, ", $2, $1}')
  echo "$name: $count instructions; $top"
done
echo "SASS in $out/; each cubin's defines and registers: $out/precompile.txt"
