#!/usr/bin/env bash
# measurements/build_time.sh BASE [ROUNDS] — how long `make -j2 build/train_bert_mini`
# takes from a fresh clone, for the commit BASE and for this checkout's HEAD,
# side by side (make build-time BASE=REV). The two are built alternately
# (BASE, HEAD, BASE, HEAD, ...: ROUNDS rounds, 2 by default), each in a new
# clone, so a machine that gets busier or quieter while it runs affects both
# alike; it prints every build's seconds, each commit's median, and the ratio
# HEAD / BASE. The machine should be otherwise idle: the figures are wall
# time, and make -j2 uses both cores of a 2-core machine.
set -eu
cd "$(dirname "$0")/.."
base=${1:?usage: measurements/build_time.sh BASE [ROUNDS]}
rounds=${2:-2}
head=$(git rev-parse --short HEAD)
base=$(git rev-parse --short "$base")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
declare -A seconds
for round in $(seq 1 "$rounds"); do
  for rev in "$base" "$head"; do
    clone="$work/$rev.$round"
    git clone -q --no-checkout . "$clone"
    git -C "$clone" checkout -q "$rev"
    start=$(date +%s.%N)
    make -C "$clone" -j2 build/train_bert_mini >"$clone.log" 2>&1 || { echo "build of $rev failed:"; tail -n 20 "$clone.log"; exit 1; }
    took=$(echo "$(date +%s.%N) - $start" | bc)
    seconds[$rev]="${seconds[$rev]:-} $took"
    printf 'round %d  %-10s %6.1f s\n' "$round" "$rev" "$took"
    rm -rf "$clone"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
base_median=$(echo "${seconds[$base]}" | median)
head_median=$(echo "${seconds[$head]}" | median)
printf '\nmake -j2 build/train_bert_mini from a fresh clone, median of %d: %s %.1f s, %s %.1f s; %s / %s = %.2f\n' \
  "$rounds" "$base" "$base_median" "$head" "$head_median" "$head" "$base" "$(echo "$head_median / $base_median" | bc -l)"
