# Sourced by the Nsight Compute scripts (ncu_batch1.sh, ncu_pair.sh) at the repository root:
# $final (where the tarball goes: the folder $OUT names, ./results when unset), $out (a scratch folder for the
# reports) and the kernel cache seeded from gpu-bin's cubins (build.sh's), so that nothing
# compiles under the profiler.
final=${OUT:-results}
out=$(mktemp -d)
mkdir -p "$final"
export MLA_CACHE_DIR=${MLA_CACHE_DIR:-/tmp/mla-cache}
if [ -d gpu-bin/cache ]; then mkdir -p "$MLA_CACHE_DIR" && cp -rn gpu-bin/cache/. "$MLA_CACHE_DIR"/; fi
