#!/usr/bin/env bash
# Copy the pinned upstream HunyuanImage-3.0 into the project root without overwriting our files.
# Usage: utils/stage_upstream.sh [SRC]
#   SRC defaults to $HUNYUAN_UPSTREAM, else ../shared/upstream/HunyuanImage-3.0, else a git clone of
#   the pinned commit. Staged files are git-ignored; upstream is never edited.
set -euo pipefail
PINNED_COMMIT=62da220178f4b0b7d83e91665a46a20a3ee4f7cd
PINNED_REPO=https://github.com/Tencent-Hunyuan/HunyuanImage-3.0.git
root=$(cd "$(dirname "$0")/.." && pwd)

src=${1:-${HUNYUAN_UPSTREAM:-}}
if [ -z "$src" ] && [ -d "$root/../shared/upstream/HunyuanImage-3.0" ]; then
  src="$root/../shared/upstream/HunyuanImage-3.0"
fi
if [ -z "$src" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "stage_upstream: no local copy; cloning $PINNED_REPO at $PINNED_COMMIT" >&2
  if ! git clone --quiet "$PINNED_REPO" "$tmp/up" || ! git -C "$tmp/up" checkout --quiet "$PINNED_COMMIT"; then
    echo "error: upstream source: no local copy and the clone failed; pass SRC or set HUNYUAN_UPSTREAM" >&2
    exit 1
  fi
  src="$tmp/up"
fi
if [ ! -f "$src/hunyuan_image_3/hunyuan.py" ]; then
  echo "error: upstream source: '$src' has no hunyuan_image_3/hunyuan.py; pass the HunyuanImage-3.0 checkout" >&2
  exit 1
fi

# Non-overwriting copy: our files (README.md, run_image_gen.py, requirements.txt, ...) win.
(cd "$src" && find . -path ./.git -prune -o -type f -print) | while read -r rel; do
  rel=${rel#./}
  case "$rel" in .gitignore) continue ;; esac
  dest="$root/$rel"
  if [ ! -e "$dest" ]; then
    mkdir -p "$(dirname "$dest")"
    cp "$src/$rel" "$dest"
  fi
done
echo "$src" > "$root/.upstream_staged"
echo "stage_upstream: staged upstream from $src" >&2
