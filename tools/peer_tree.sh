#!/usr/bin/env bash
# Assemble DeepGEMM's source tree for tools/device_peer.sh (the indexer's peer, built on the
# GPU machine) from local git mirrors of deepseek-ai/DeepGEMM, NVIDIA/cutlass and
# fmtlib/fmt, at the commits DeepGEMM's .gitmodules pins. Only cutlass's include/ and fmt's
# include/ and src/ are copied (~29 MB in all), so the tree fits a device call's carry.
# Usage: bash tools/peer_tree.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [REV] [OUT=.peer]
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 DEEPGEMM_GIT CUTLASS_GIT FMT_GIT [REV] [OUT]" >&2; exit 2; }
dg=$1 cutlass=$2 fmt=$3 rev=${4:-HEAD} out=${5:-.peer}
[ ! -e "$out" ] || { echo "$out exists: remove it first" >&2; exit 2; }
pin() { git -C "$dg" ls-tree "$rev" "third-party/$1" | awk '{print $3}'; }
mkdir -p "$out/third-party/cutlass" "$out/third-party/fmt"
git -C "$dg" archive "$rev" | tar x -C "$out"
git -C "$cutlass" archive "$(pin cutlass)" include/cute include/cutlass | tar x -C "$out/third-party/cutlass"
git -C "$fmt" archive "$(pin fmt)" include src CMakeLists.txt | tar x -C "$out/third-party/fmt"
echo "$out: DeepGEMM $(git -C "$dg" rev-parse --short "$rev"), cutlass $(pin cutlass | cut -c1-7), fmt $(pin fmt | cut -c1-7) ($(du -sh "$out" | cut -f1))"
