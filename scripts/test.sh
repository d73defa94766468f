#!/usr/bin/env bash
# The test suite: unit tests, torchrun, real-browser and the notebooks (run by nbval).
#   bash scripts/test.sh                      # everything: pyproject's testpaths, tests/ and notebooks/
#   bash scripts/test.sh -x                   # any pytest options
#   bash scripts/test.sh tests/test_demo.py   # only what is named
# With no arguments, the core tests then run a second time on the torch reduction path (the
# one GPUs take), with the native CPU kernel switched off.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Notebook kernels and torchrun workers are subprocesses: they import this checkout's nanwidget
# through PYTHONPATH whether or not it was installed with pip install -e.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# --nbval-lax: run every notebook cell, compare only the outputs of "# NBVAL_CHECK_OUTPUT" cells.
# --nbval-current-env: the kernel runs in this Python, not whatever "python3" kernelspec is found.
"$PY" -m pytest -q --nbval-lax --nbval-current-env "$@"
if [ "$#" -eq 0 ]; then
  echo "--- again on the torch reduction path (NANWIDGET_NATIVE=0)"
  NANWIDGET_NATIVE=0 "$PY" -m pytest -q tests/test_recording.py tests/test_detection.py \
    tests/test_odd_inputs.py tests/test_hot_path.py tests/test_replay.py tests/test_lifecycle.py \
    tests/test_sentinel.py tests/test_sentinel_equality.py
fi
