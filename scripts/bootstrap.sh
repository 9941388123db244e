#!/usr/bin/env bash
# Create (or refresh) .venv with CPU torch 2.13.0 and rlvitals[dev], editable.
# Idempotent and quick when nothing changed: a stamp records the pyproject it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${RLVITALS_EXTRAS:-dev}
if [ ! -x .venv/bin/python ]; then
  # Debian ships venv's ensurepip separately (python3-venv); a plain machine lacks it.
  if ! "$PY" -c 'import ensurepip' 2>/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv >/dev/null
  fi
  "$PY" -m venv .venv
fi
# a C compiler and Python's headers build the audit's compiled token passes (analyzers/csrc); without
# them the install still works and the audit runs torch ops (slower), so only a root apt machine adds them
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if { ! command -v cc >/dev/null || [ ! -f "$inc/Python.h" ]; } && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq gcc libc6-dev python3-dev >/dev/null
fi
stamp=".venv/.rlvitals-$EXTRA.sha"
# the compiled token passes (analyzers/csrc) are built by the editable install: their sources count too
want=$(cat pyproject.toml setup.py analyzers/csrc/* | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade "pip>=24"
  # CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
  if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
      .venv/bin/python -m pip install -q "torch==2.13.0"
    else
      .venv/bin/python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  .venv/bin/python -m pip install -q -e ".[$EXTRA]"
  echo "$want" > "$stamp"
fi
