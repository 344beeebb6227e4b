#!/usr/bin/env bash
# Puts NVRTC 13.0 (the version of the GPU machines' driver) from PyPI into target/nvrtc and
# prints the library folder to add to LD_LIBRARY_PATH. No GPU and no CUDA toolkit needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=target/nvrtc
lib="$dest/nvidia/cu13/lib"
if [ ! -f "$lib/libnvrtc.so.13" ]; then
  mkdir -p "$dest"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest" nvidia-cuda-nvrtc==13.0.88 >&2
  python3 -c 'import sys, zipfile, glob; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[1] + "/*.whl")]' "$dest"
fi
echo "$PWD/$lib"
