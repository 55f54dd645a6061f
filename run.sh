#!/usr/bin/env bash
# Launch a job from a YAML config: run.sh [CONFIG_YAML] [--dry-run]
# Check this node first: run.sh --selfcheck [--device npu|cuda|cpu] [--nproc N] (utils/selfcheck/)
# Default config: config/tiny_cpu.yaml. Keys: config/README.md. Logic: utils/launcher/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then
  py=$root/.venv/bin/python
else
  py=python3
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: PYTHON: '$py' is not an executable; set PYTHON to a Python with torch installed" >&2
  exit 2
fi
# As a module with the project root on the path; the cwd stays the user's (a CONFIG_YAML path is
# relative to it), and -P keeps a utils/ in that cwd from shadowing ours.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -P -m utils.launcher "$@"
