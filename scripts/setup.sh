#!/usr/bin/env bash
# Install nanwidget with what its tests and the README's next steps need, on a fresh machine:
# torch (CPU build), nanwidget in editable mode with its test tools, JupyterLab, a Jupyter
# kernel, and Chromium for the real-browser tests. Says what it is doing at each step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
started=$SECONDS
step() { printf 'setup [%s/5] %s\n' "$1" "$2"; }
done_step() { printf 'setup       ok (%ss so far)\n' "$((SECONDS - started))"; }

# pyproject.toml's floor: an older torch would make pip fetch PyPI's CUDA build in step 2.
torch_floor=2.10
installed=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
at_least_floor() {  # "2.13.0+cpu" against "2.10": major and minor
  "$PY" -c 'import sys; major_minor = lambda v: [int(p) for p in v.split("+")[0].split(".")[:2]]
sys.exit(major_minor(sys.argv[1]) < major_minor(sys.argv[2]))' "$1" "$torch_floor"
}
if [ -n "$installed" ] && ! at_least_floor "$installed"; then
  # Which build replaces it (CPU, or CUDA for a GPU) is the owner's choice, not this script's.
  echo "setup: torch $installed is older than the $torch_floor nanwidget needs. Upgrade it" \
       "first (the CPU build: $PY -m pip install -U --index-url" \
       "https://download.pytorch.org/whl/cpu torch), then run this again." >&2
  exit 1
elif [ -n "$installed" ]; then
  step 1 "torch: already installed ($installed)"
else
  # PyTorch's CPU index first (a few hundred MB, not the multi-GB CUDA build PyPI serves),
  # where it answers: one quiet look with a short timeout, not pip's retries against a
  # closed network. Elsewhere the pinned release from PyPI (a local CPU wheel on our machines).
  step 1 "torch: installing the CPU build (a few hundred MB; the longest step, minutes on a slow link)"
  cpu_index=https://download.pytorch.org/whl/cpu
  if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5).close()' \
       "$cpu_index/torch/" >/dev/null 2>&1; then
    "$PY" -m pip install -q --index-url "$cpu_index" torch==2.13.0 \
      || "$PY" -m pip install -q --index-url "$cpu_index" "torch>=$torch_floor"
  else
    echo "setup       PyTorch's CPU index (download.pytorch.org) is not reachable:" \
         "torch==2.13.0 from PyPI"
    "$PY" -m pip install -q torch==2.13.0
  fi
  done_step
fi

step 2 "nanwidget (editable), its test tools and the transformers/lightning/accelerate extras"
"$PY" -m pip install -q -e ".[dev,bench,transformers,lightning,accelerate]"
done_step

# The README's next step is `jupyter lab notebooks/01_quickstart.ipynb`: JupyterLab comes with
# the dev extra above; say so plainly if it did not arrive.
step 3 "JupyterLab, for \`jupyter lab notebooks/01_quickstart.ipynb\`"
if "$PY" -c "import jupyterlab" 2>/dev/null; then
  echo "setup       JupyterLab $("$PY" -c 'import jupyterlab; print(jupyterlab.__version__)')"
else
  "$PY" -m pip install -q "jupyterlab>=4"
fi
done_step

# The Jupyter kernel the notebooks (and nbval) run in: this Python, as "python3".
step 4 "the Jupyter kernel \"python3\" (this Python)"
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
done_step

# Chromium for the real-browser tests (Debian package; Playwright drives it).
step 5 "Chromium for the real-browser tests"
if [ -x /usr/bin/chromium ]; then
  echo "setup       already installed: /usr/bin/chromium"
elif command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 \
    || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
    || echo "setup       chromium not installed; the browser tests will be skipped"
else
  echo "setup       no apt-get here: install Chromium at /usr/bin/chromium to run the browser tests"
fi
done_step
echo "setup done in $((SECONDS - started))s. Next: python -m nanwidget demo, then" \
     "jupyter lab notebooks/01_quickstart.ipynb"
