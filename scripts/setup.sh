#!/usr/bin/env bash
# Install nanwidget with its test tools on a fresh machine (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # PyTorch's CPU index first (a few hundred MB, not the multi-GB CUDA build PyPI serves);
  # where only PyPI is reachable, the pinned release (a local CPU wheel on our CI machines).
  cpu_index="--retries 1 --timeout 20 --index-url https://download.pytorch.org/whl/cpu"
  "$PY" -m pip install -q $cpu_index torch==2.13.0 \
    || "$PY" -m pip install -q $cpu_index "torch>=2.2" \
    || "$PY" -m pip install -q torch==2.13.0
fi
# The training-framework extras too: their callbacks and the Accelerate recipe are tested.
"$PY" -m pip install -q -e ".[dev,bench,transformers,lightning,accelerate]"
# The Jupyter kernel the notebooks (and nbval) run in: this Python, as "python3".
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
# Chromium for the real-browser test (Debian package; Playwright drives it).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
    || echo "setup: chromium not installed; the browser test will be skipped"
fi
