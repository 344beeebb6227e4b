#!/usr/bin/env bash
# Builds another branch (or commit) for an A/B on the GPU machine, into gpu-bin-NAME beside
# main's gpu-bin (ignored: .gitignore has gpu-bin*), through a git worktree that shares one
# cargo target folder (target-branches, beside this checkout's target) so that rebuilds stay
# incremental.
#   scripts/gpu/build_branch.sh REV NAME [--lean]
# --lean keeps only the CLI and the cubin cache (for a before/after: scripts/gpu/ab.sh, or
# run.sh anchors with MLA_BEFORE=gpu-bin-NAME; a few MiB to copy), else the whole gpu-bin
# (test binaries and wheel too).
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$1 name=$2 lean=${3:-}
root=$PWD
wt=$(mktemp -d)/wt
git worktree add -q --detach "$wt" "$rev"
trap 'git -C "$root" worktree remove --force "$wt"' EXIT
mkdir -p "$root/target-branches"
ln -s "$root/target-branches" "$wt/target"
(cd "$wt" && scripts/gpu/build.sh >&2)
rm -rf "$root/gpu-bin-$name"
if [ "$lean" = --lean ]; then
  mkdir -p "$root/gpu-bin-$name"
  cp -r "$wt/gpu-bin/mla" "$wt/gpu-bin/cache" "$root/gpu-bin-$name/"
else
  cp -r "$wt/gpu-bin" "$root/gpu-bin-$name"
fi
du -sh "$root/gpu-bin-$name"
