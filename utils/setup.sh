#!/usr/bin/env bash
# Prepare a fresh checkout: a .venv with the pinned requirements, and upstream staged in.
# Idempotent and quick when already done. PYTHON picks the interpreter (default python3, 3.11).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($py --version 2>&1)" >&2
  "$py" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing requirements.txt (torch is large; this takes a few minutes once)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
if [ ! -f hunyuan_image_3/hunyuan.py ]; then
  bash utils/stage_upstream.sh
fi
echo "setup: ready (.venv, upstream staged)" >&2
