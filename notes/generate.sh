#!/usr/bin/env bash
# notes/generate.sh BUILD_DIR — regenerate every measured table in notes/*.md
# and the output excerpt in README.md.
# A table sits between
#     <!-- begin generated: NAME -->  and  <!-- end generated: NAME -->
# and is replaced by what the command for NAME prints now; nothing in those
# blocks is typed by hand. Run through `make notes`.
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
demo="$build/demo_stages"
[ -x "$demo" ] || { echo "no $demo: run make first"; exit 1; }
export OPENBLAS_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The model for the ledger tables: the test MLP at 512 wide, 16 layers
# (about 4 M parameters), 64 Ki-element buckets.
model="--device cpu --hidden 512 --layers 16 --micro-batch 16 --bucket 65536 --steps 2"

# ledger: memory and communication per rank, N = 1, 2, 4 x stage 0, 1, 2.
{
  echo "Measured by \`make notes\` (\`mpirun -n N $demo $model --markdown ledger\`). Bytes per rank;"
  echo "the communication columns are bytes sent per optimizer step (A = 1)."
  echo
  echo "| N | stage | Psi_padded | params | grads | optimizer (m, v) | model states | formula | staging | sent per step | formula |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  for ranks in 1 2 4; do
    timeout 300 mpirun -n "$ranks" "$demo" $model --markdown ledger
  done
} >"$out/ledger"

# hashes: the same global batch split as (N, A) = (1,4), (2,2), (4,1).
{
  echo "Measured by \`make notes\` (\`mpirun -n N $demo --device cpu --accum A --markdown hashes\`): the"
  echo "test MLP, 8 steps, global batch 4 micro-batches of 8 samples. Loss of the last step and FNV-1a hash"
  echo "of the final parameters."
  echo
  echo "| N | A | stage | collectives | last loss | loss bits | final parameters hash |"
  echo "|---|---|---|---|---|---|---|"
  for pair in "1 4" "2 2" "4 1"; do
    set -- $pair
    timeout 300 mpirun -n "$1" "$demo" --device cpu --accum "$2" --markdown hashes
  done
  timeout 300 mpirun -n 4 "$demo" --device cpu --accum 1 --collectives native --markdown hashes
} >"$out/hashes"

# demo: the stage-2 part of `make run`'s output, for the README.
{
  echo '```'
  timeout 300 mpirun -n 2 "$demo" --device cpu | awk '/^stage 2 /{show=1} show'
  echo '```'
} >"$out/demo"

python3 - "$out" README.md notes/*.md <<'PY'
import os, re, sys
blocks = sys.argv[1]
for path in sys.argv[2:]:
    text = open(path).read()
    def fill(match):
        name = match.group(1)
        body = open(os.path.join(blocks, name)).read().rstrip("\n")
        return f"<!-- begin generated: {name} -->\n{body}\n<!-- end generated: {name} -->"
    new = re.sub(r"<!-- begin generated: (\S+) -->.*?<!-- end generated: \1 -->", fill, text, flags=re.S)
    if new != text:
        open(path, "w").write(new)
        print(f"updated {path}")
PY
