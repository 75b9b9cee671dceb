# Helpers of scripts/device_run.sh that decide what a device call runs, kept apart so that the CPU
# tests can run them (tests/test_device_scripts.py): a lost device call costs minutes of a session's
# thirty, and the forty-ninth session lost a combined build's tests to the `-k` joining below.

# A builds entry's name: main, or its patch files' names less .patch ("a.patch+b.patch": "a+b").
variant() { local p names=""; for p in ${1//+/ }; do names+="${names:++}$(basename "${p%.patch}")"; done; echo "$names"; }

# The pytest arguments of a builds entry's GPU tests into the array `test_args`: the lines of each
# part's NAME.tests beside NAME.patch (one argument a line, `-k` and its expression on two). A combined
# entry runs its parts' lists together with their `-k`s joined by "or" (pytest keeps the last -k
# alone); a part without a `-k` runs its files whole, so then none applies. Returns 1 where no part
# lists tests.
queue_test_args() {
  local part k i whole=0 ks=() more=()
  test_args=()
  for part in ${1//+/ }; do
    [ -f "${part%.patch}.tests" ] || continue
    mapfile -t more < "${part%.patch}.tests"
    k=""
    for ((i = 0; i < ${#more[@]}; i++)); do
      if [ "${more[$i]}" = -k ]; then i=$((i + 1)); k=${more[$i]}; else test_args+=("${more[$i]}"); fi
    done
    if [ -n "$k" ]; then ks+=("($k)"); else whole=1; fi
  done
  [ ${#test_args[@]} -gt 0 ] || return 1
  if [ $whole = 0 ] && [ ${#ks[@]} -gt 0 ]; then k=$(printf ' or %s' "${ks[@]}"); test_args+=(-k "${k# or }"); fi
}
