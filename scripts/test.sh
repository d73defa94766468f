#!/usr/bin/env bash
# The test suite: unit tests, torchrun, real-browser and notebook tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pytest -q "$@"
