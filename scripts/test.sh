#!/usr/bin/env bash
# The test suite: unit tests, torchrun, real-browser and the notebooks (run by nbval).
#   bash scripts/test.sh                      # everything: pyproject's testpaths, tests/ and notebooks/
#   bash scripts/test.sh -x                   # any pytest options
#   bash scripts/test.sh tests/test_demo.py   # only what is named
# With no arguments, the core tests then run a second time on the torch reduction path (the
# one GPUs take), with the native CPU kernel switched off. Both passes run even when the first
# fails; each ends with a one-line summary, and the exit status is non-zero if either failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Notebook kernels and torchrun workers are subprocesses: they import this checkout's nanwidget
# through PYTHONPATH whether or not it was installed with pip install -e.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

summaries=()
failed=0
# Runs pytest with the given arguments, keeps its closing line for the summary at the end.
run_pass() {
  local name=$1 started=$SECONDS log status closing
  shift
  log=$(mktemp)
  # through tee, pytest no longer sees a terminal: keep its colours where there is one
  if [ -t 1 ]; then set -- --color=yes "$@"; fi
  "$PY" -m pytest "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  # pytest's closing line ("3 failed, 620 passed in 412.3s", ruled with "=" when not -q)
  local counts='[0-9a-z ,]*(passed|failed|errors?|skipped|deselected|no tests ran)[0-9a-z ,]*'
  closing=$(grep -E "^(=+ )?$counts in [0-9.]+s" "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  rm -f "$log"
  if [ "$status" -ne 0 ]; then failed=1; fi
  summaries+=("$(printf '%-28s %s (exit %s, %ss)' "$name:" "${closing:-no summary from pytest}" \
                 "$status" "$((SECONDS - started))")")
}

# --nbval-lax: run every notebook cell, compare only the outputs of "# NBVAL_CHECK_OUTPUT" cells.
# --nbval-current-env: the kernel runs in this Python, not whatever "python3" kernelspec is found.
run_pass "tests and notebooks" -q --nbval-lax --nbval-current-env "$@"
if [ "$#" -eq 0 ]; then
  echo "--- again on the torch reduction path (NANWIDGET_NATIVE=0)"
  NANWIDGET_NATIVE=0 run_pass "NANWIDGET_NATIVE=0 core" -q tests/test_recording.py \
    tests/test_detection.py tests/test_odd_inputs.py tests/test_hot_path.py tests/test_replay.py \
    tests/test_lifecycle.py tests/test_sentinel.py tests/test_sentinel_equality.py
fi
echo "--- summary"
printf '%s\n' "${summaries[@]}"
exit "$failed"
