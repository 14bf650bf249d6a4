#!/usr/bin/env bash
# tests/cli/metrics.sh BUILD_DIR — metrics while training: --metrics writes a line per progress line with
# the mean loss since the last one; a killed run leaves whole lines; --eval-every: the held-out loss has the
# same bits in every (N, A, stage), its frequency does not change training, a resume continues it. Ends
# with "N passed, M failed".
source "$(dirname "$0")/common.sh" "$@"

metrics_lines() {
  echo "=== --metrics and --eval-every: progress as training goes, the held-out loss"
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 30 --log-every 10 --metrics "$work/metrics.jsonl" \
    --json "$work/metrics_run.json" \
    > /dev/null 2>&1
  verdict=$(py metrics lines "$work/metrics.jsonl" "$work/metrics_run.json")
  [ "$verdict" = ok ] && pass "--metrics: lines at steps 1, 10, 20, 30; loss_mean = the mean of the --json losses" \
    "since the last line; elapsed rises, ETA ends at 0" ||
    fail "--metrics: $verdict"
}

# A run killed mid-way leaves whole lines only.
killed_run() {
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 100000 --log-every 100 \
    --metrics "$work/killed.jsonl" > /dev/null 2>&1 &
  job=$!
  for k in $(seq 1 200); do [ -f "$work/killed.jsonl" ] && [ "$(wc -l < "$work/killed.jsonl")" -ge 5 ] && \
    break; sleep 0.05; done
  pkill -KILL -f "^$trainer .*$work/killed.jsonl"
  wait $job
  py metrics whole_lines "$work/killed.jsonl" > "$work/log" 2>&1 &&
    pass "a run killed by SIGKILL: --metrics holds $(cat "$work/log") whole lines, none cut" || fail "killed" \
      "--metrics: $(cat "$work/log")"
  bad_case "--metrics '$work/corpus.txt' is the --data file" "${one_layer[@]}" --steps 2 --data "$work/corpus.txt" \
    --metrics "$work/corpus.txt"
}

# --eval-every: the held-out loss is the same bits at every (N, A, stage);
# how often it runs does not change training; bad values refused.
eval_every() {
  ev_bad=""
  for run in "1 4 0" "2 2 1" "4 1 2"; do
    set -- $run
    timeout 120 mpirun -n $1 "$trainer" "${one_layer[@]}" --accum $2 --stage $3 --steps 6 --eval-every 3 \
      --json "$work/eval_$1.json" \
      > /dev/null 2>&1 || ev_bad="$ev_bad (N=$1 failed)"
  done
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --accum 2 --steps 6 --eval-every 6 --metrics "$work/eval.jsonl" \
    --json "$work/eval_rare.json" \
    > /dev/null 2>&1
  verdict=$(py metrics evaluations "$work"/eval_1.json "$work"/eval_2.json "$work"/eval_4.json \
    "$work/eval_rare.json" "$work/eval.jsonl")
  [ -z "$ev_bad" ] && [ "$verdict" = ok ] &&
    pass "--eval-every: the held-out loss has the same bits at (N, A, stage) = (1,4,0), (2,2,1), (4,1,2); every 3 or" \
      "every 6 trains the same; it is in --metrics" ||
    fail "--eval-every:$ev_bad $verdict"
  bad_case "--eval-every 10 is more than --steps 2" "${one_layer[@]}" --steps 2 --eval-every 10
  printf 'abcdefghijklmnopqrstuvwxyz' > "$work/tiny_corpus.txt"
  bad_case "--eval-every holds out the data's last 14 bytes" "${one_layer[@]}" --steps 2 --eval-every 1 \
    --data "$work/tiny_corpus.txt"
  timeout 120 mpirun -n 2 "$trainer" "${one_layer[@]}" --steps 4 --eval-every 2 --save "$work/ck_eval" > /dev/null 2>&1
  bad_case "--eval-every 0 keeps the data's tail in training, and the checkpoint's run" --load "$work/ck_eval" \
    --eval-every 0 --steps 6
  timeout 120 mpirun -n 2 "$trainer" --load "$work/ck_eval" --steps 6 --quiet --json "$work/eval_resumed.json" \
    > "$work/log" 2>&1 &&
    [ "$(json_get "$work/eval_resumed.json" "[e['step'] for e in d['eval']]")" = "[6]" ] &&
    pass "resumed without --eval-every: the saved one (every 2) continues" || fail "eval resume:" \
      "$(head -c 200 "$work/log")"
}

quick eval_every
all metrics_lines
all killed_run
finish
