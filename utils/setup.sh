#!/usr/bin/env bash
# Prepare a fresh checkout: a .venv with the pinned requirements, and upstream staged in.
# Idempotent and quick when already done. PYTHON picks the interpreter (default python3, 3.11).
#   bash utils/setup.sh            .venv from requirements.txt (torch 2.14.1, transformers 5.23.0)
#   bash utils/setup.sh --compat   .venv-compat from requirements-compat.txt (torch 2.7.1,
#                                  transformers 5.2.0: the torch_npu 2.7.1 stack; CI's compat tier)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
venv=.venv
requirements=requirements.txt
case "${1:-}" in
  "") ;;
  --compat) venv=.venv-compat; requirements=requirements-compat.txt ;;
  *) echo "error: arguments: unknown '$1'; use no argument or --compat" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $($py --version 2>&1)" >&2
  "$py" -m venv "$venv"
fi
stamp=$venv/.requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing $requirements into $venv (torch is large; this takes a few minutes once)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -r "$requirements"
  echo "$want" > "$stamp"
fi
bash utils/stage_upstream.sh      # a no-op when the pinned commit is staged; replaces an older pin's files
echo "setup: ready ($venv, upstream staged)" >&2
