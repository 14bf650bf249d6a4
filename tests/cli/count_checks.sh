#!/usr/bin/env bash
# tests/cli/count_checks.sh BUILD_DIR [OLD_COMMIT] — the command line's checks counted before and after the
# suite was split by capability (issue 37): the one script of OLD_COMMIT (default e4ee5a5,
# tests/test_trainer.sh, 15 sections) run with a marker before each section that prints the running
# counts, and each file of tests/cli run alone (every check), side by side, one row per old section and
# its file; then the checker (tests/test_checker.sh then, tests/cli/checker.sh now). Both suites are run
# here, on this build (about ten minutes on 2 cores). Not part of the suite.
set -u
cd "$(dirname "$0")/../.."
build=${1:-build}
old_commit=${2:-e4ee5a5}
export OPENBLAS_NUM_THREADS=1
scratch=$(mktemp -d /tmp/z2_count.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

# The old script, as it was, with "@@ N PASSED FAILED" printed before section N and at its end; beside it
# the files it read through its own directory (dirname "$0"), as they were.
mkdir -p "$scratch/tests"
for file in golden_bits.txt verify.sh gpu_check.sh test_checker.sh; do
  git show "$old_commit:tests/$file" > "$scratch/tests/$file"
done
chmod +x "$scratch/tests/"*.sh
git show "$old_commit:tests/test_trainer.sh" |
  awk '/^# --- [0-9]+\./ { n = $3; sub(/\./, "", n); print "echo \"@@ " n " $passed $failed\"" }
       /^echo "\$passed passed, \$failed failed"$/ { print "echo \"@@ end $passed $failed\"" }
       { print }' > "$scratch/tests/test_trainer.sh"
chmod +x "$scratch/tests/test_trainer.sh"
echo "running $old_commit's tests/test_trainer.sh $build ..."
"$scratch/tests/test_trainer.sh" "$build" > "$scratch/old.log" 2>&1
echo "running $old_commit's tests/test_checker.sh $build ..."
# (it changes to the directory above its own: the old checker script runs from a copy of the tree's tests/)
mkdir -p "$scratch/tree" && cp -r tests "$scratch/tree/" && cp "$scratch/tests/test_checker.sh" "$scratch/tree/tests/"
ln -s "$PWD/$build" "$scratch/tree/$build" 2>/dev/null
ln -s "$PWD/.venv-hf" "$scratch/tree/.venv-hf" 2>/dev/null
"$scratch/tree/tests/test_checker.sh" "$build" > "$scratch/old_checker.log" 2>&1

files=(stages ledgers bad_input torch_reference zero_r precision reliability checkpoints deepspeed_configs hugging_face
       metrics plan portable traces offload)
summary() { grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1; }
checks() { local line; line=$(summary "$1"); [ -n "$line" ] && echo \
  $(( ${line%% *} + $(echo "$line" | cut -d' ' -f3) )); }
for name in "${files[@]}" checker; do
  echo "running tests/cli/$name.sh $build ..."
  "tests/cli/$name.sh" "$build" > "$scratch/$name.log" 2>&1
done

# The markers' running counts, differenced: the checks (passed + failed) of each old section.
mapfile -t marks < <(grep -E '^@@ ' "$scratch/old.log")
printf '\n%-4s %-48s %7s   %-28s %7s\n' "" "old section (tests/test_trainer.sh at $old_commit)" "checks" \
  "new file (tests/cli)" "checks"
old_total=0 new_total=0
for k in $(seq 0 $((${#marks[@]} - 2))); do
  read -r _ section p0 f0 <<< "${marks[$k]}"
  read -r _ _ p1 f1 <<< "${marks[$((k + 1))]}"
  old=$(( (p1 + f1) - (p0 + f0) ))
  title=$(git show "$old_commit:tests/test_trainer.sh" | grep -E "^# --- $section\. " |
    sed -E 's/^# --- [0-9]+\. //; s/ -+$//' | cut -c1-44)
  name=${files[$((section - 1))]}
  new=$(checks "$scratch/$name.log")
  printf '%-4s %-48s %7s   %-28s %7s\n' "§$section" "$title" "$old" "$name.sh" "${new:-?}"
  old_total=$((old_total + old)); new_total=$((new_total + ${new:-0}))
done
old_checker=$(checks "$scratch/old_checker.log")
new_checker=$(checks "$scratch/checker.log")
printf '%-4s %-48s %7s   %-28s %7s\n' "" "tests/test_checker.sh" "${old_checker:-?}" "checker.sh" "${new_checker:-?}"
printf '%-4s %-48s %7s   %-28s %7s\n' "" "in all" "$((old_total + ${old_checker:-0}))" "" \
  "$((new_total + ${new_checker:-0}))"
echo "(failed checks, if any, are counted too: old $(summary "$scratch/old.log"); the files' own lines are in"
echo " each log; a mismatch on a row means a check was added or dropped there)"
