#!/usr/bin/env bash
# Writes the Triton kernel modules of an older commit into a folder, for the scripts that compare
# the current kernels with them (bench/equal_v0.py, bench_cuda.py, speed_sweep.py: --base DIR).
# Runs on a machine with the git history (the GPU machine gets only the working tree):
#   bash bench/old_kernels.sh [REF] [DIR]
#     REF  default b7c66ae: the kernels first measured on the H200 (bench/results/h200-2026-11-29)
#     DIR  default .old_kernels at the repository root (ignored by git; carry it to the GPU machine)
# Every module of the commit's kernel folder (hal/kernels/ or, before the move, backends/cuda/) is
# written except the package's __init__.py; their imports of each other become relative, so the old
# modules never pick up a current one. Other imports (hal.errors, triton, ...) are left as they are.
set -euo pipefail
ref=${1:-b7c66ae}
dir=${2:-$(git rev-parse --show-toplevel)/.old_kernels}
sha=$(git rev-parse --verify "$ref^{commit}")
src=
for candidate in hal/kernels backends/cuda; do
  if git cat-file -e "$sha:$candidate/gemm.py" 2>/dev/null; then src=$candidate; break; fi
done
[ -n "$src" ] || { echo "old_kernels.sh: $ref has neither hal/kernels/gemm.py nor backends/cuda/gemm.py" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir"
for path in $(git ls-tree --name-only "$sha" "$src/" | grep '\.py$'); do
  name=$(basename "$path")
  [ "$name" = __init__.py ] && continue
  git show "$sha:$path" | sed -E \
    -e 's/^([[:space:]]*)from hal\.(backends\.cuda|kernels)\.([A-Za-z_][A-Za-z0-9_]*) import /\1from .\3 import /' \
    -e 's/^([[:space:]]*)from hal\.(backends\.cuda|kernels) import /\1from . import /' > "$dir/$name"
done
if grep -nE '(from|import) hal\.(backends\.cuda|kernels)\b' "$dir"/*.py; then
  echo "old_kernels.sh: an import above would load a current kernel module; extend the rewrite" >&2
  exit 1
fi
printf '"""Kernel modules of %s (%s), written by bench/old_kernels.sh from %s/."""\n' "$ref" "$sha" "$src" \
  > "$dir/__init__.py"
echo "$dir: $(cd "$dir" && ls -- *.py | grep -v __init__ | tr '\n' ' ')from $src/ at $sha"
