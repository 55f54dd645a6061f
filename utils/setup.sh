#!/usr/bin/env bash
# Prepare a fresh checkout: the system packages the tests need, a .venv with the pinned requirements,
# and upstream staged in. Idempotent and quick when already done. PYTHON picks the interpreter
# (default python3, 3.11).
#   bash utils/setup.sh            .venv from requirements.txt (torch 2.14.1, transformers 5.23.0)
#   bash utils/setup.sh --compat   .venv-compat from requirements-compat.txt (torch 2.7.1,
#                                  transformers 5.2.0: the torch_npu 2.7.1 stack; CI's compat tier)
# System packages (both forms): Debian's chromium and chromium-driver, which the page's browser tests
# drive (tests/browser.py), installed with apt-get as root or through a non-interactive sudo; a user
# who can do neither gets one line saying what to install, and the rest of the setup goes on.
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
system_packages() {
  if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then      # where tests/browser.py looks
    return 0
  fi
  local as_root=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      as_root=(sudo -n)
    else
      echo "setup: the page's browser tests need Debian's chromium and chromium-driver: run" \
           "'apt-get install chromium chromium-driver' as root (this user can neither apt-get nor sudo)" >&2
      return 0
    fi
  fi
  if ! command -v apt-get >/dev/null; then
    echo "setup: the page's browser tests need chromium and chromedriver at /usr/bin (Debian's chromium" \
         "and chromium-driver); no apt-get here: install them with this system's package manager" >&2
    return 0
  fi
  echo "setup: installing chromium and chromium-driver (Debian packages) for the page's browser tests" >&2
  if ! { "${as_root[@]}" apt-get update -qq >/dev/null &&
         "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }; then
    echo "setup: apt-get could not install chromium and chromium-driver (its error above); the page's browser" \
         "tests fail until they are installed" >&2
  fi
}
system_packages
bash utils/stage_upstream.sh      # a no-op when the pinned commit is staged; replaces an older pin's files
echo "setup: ready ($venv, upstream staged)" >&2
