#!/usr/bin/env bash
# Copy the pinned upstream HunyuanImage-3.0 into the project root; never over a file of ours.
# Usage: utils/stage_upstream.sh [SRC]
#   SRC defaults to $HUNYUAN_UPSTREAM, else ../shared/upstream/HunyuanImage-3.0-1ea1526, else a git clone of
#   the pinned commit. Staged files are git-ignored; upstream is never edited.
# Pin-aware: .upstream_staged records the staged commit and every file staged. With the pin already
# staged (and no SRC given) nothing happens; when the pin changes, the files staged before are
# replaced (or removed when the new pin has no such file). A file that exists but was not staged by
# this script (ours: README.md, run_image_gen.py, requirements.txt, utils/__init__.py, ...) is never touched.
set -euo pipefail
PINNED_COMMIT=1ea1526fe6d953ef44712b31014b60137bab0894
PINNED_REPO=https://github.com/Tencent-Hunyuan/HunyuanImage-3.0.git
ALLOW_MISMATCH_ENV=HUNYUAN_ADAPTOR_ALLOW_UPSTREAM_MISMATCH
# What is taken from upstream (its app/, docker/, vllm_infer/ and other assets are not used).
STAGED_PATHS="hunyuan_image_3 utils PE assets/demo_instruct_imgs LICENSE Notice README.md README_zh_CN.md
  Hunyuan-Image3.md setup.py pyproject.toml requirements.txt run_image_gen.py run_demo_instruct.sh
  run_demo_instruct_distil.sh"
# Files that identify the pinned commit (model_adaptor.PINNED_UPSTREAM_SHA256 holds the same values).
PINNED_SHA256="8bef90aa2166525ee719fcc33b515cb1f6566c852b4578722a69853bc88c4cc5  hunyuan_image_3/modeling_hunyuan_image_3.py
89ba90331b5d8ef4a76d65585328ed6ad96197c4505b8fa1d3de670d2964d636  hunyuan_image_3/hunyuan.py
a0ee7fc23ed4818570a3c91b12a5396e9a2fdb12737120aa0c5fcd2cf249309d  hunyuan_image_3/__init__.py"
# What the previous pin (62da220) staged, for checkouts whose stamp predates the file list.
LEGACY_STAGED="hunyuan_image_3/__init__.py hunyuan_image_3/autoencoder_kl_3d.py hunyuan_image_3/configuration_hunyuan.py
  hunyuan_image_3/hunyuan.py hunyuan_image_3/hunyuan_image_3_pipeline.py hunyuan_image_3/image_processor.py
  hunyuan_image_3/siglip2.py hunyuan_image_3/system_prompt.py hunyuan_image_3/tokenizer_wrapper.py
  PE/deepseek.py PE/system_prompt.py LICENSE Notice README_zh_CN.md setup.py pyproject.toml run_app.sh"

root=$(cd "$(dirname "$0")/.." && pwd)
stamp="$root/.upstream_staged"
src=${1:-${HUNYUAN_UPSTREAM:-}}

staged_before() {       # the file list of the stamp, or the previous pin's for an old one-line stamp
  if [ -f "$stamp" ] && head -n1 "$stamp" | grep -q '^commit '; then
    tail -n +3 "$stamp"
  elif [ -f "$stamp" ]; then
    printf '%s\n' $LEGACY_STAGED
  fi
}

tracked() {             # a file of ours (git knows it); false outside a git checkout
  git -C "$root" ls-files --error-unmatch -- "$1" >/dev/null 2>&1
}

if [ -z "$src" ] && [ "$(head -n1 "$stamp" 2>/dev/null)" = "commit $PINNED_COMMIT" ]; then
  missing=0
  while read -r rel; do [ -e "$root/$rel" ] || missing=1; done < <(staged_before)
  if [ "$missing" = 0 ]; then
    exit 0      # the pin is staged
  fi
fi

if [ -z "$src" ] && [ -d "$root/../shared/upstream/HunyuanImage-3.0-1ea1526" ]; then
  src="$root/../shared/upstream/HunyuanImage-3.0-1ea1526"
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
commit=$PINNED_COMMIT
if ! (cd "$src" && echo "$PINNED_SHA256" | sha256sum --check --quiet --status 2>/dev/null); then
  if [ "${!ALLOW_MISMATCH_ENV:-}" != 1 ]; then
    echo "error: upstream source: '$src' is not commit ${PINNED_COMMIT:0:7} (its hunyuan_image_3 files differ);" \
         "pass a checkout of ${PINNED_COMMIT:0:7}, or set $ALLOW_MISMATCH_ENV=1 to stage it anyway" >&2
    exit 1
  fi
  commit=unpinned
fi

new_list=$(cd "$src" && for path in $STAGED_PATHS; do
  if [ -d "$path" ]; then
    find "$path" -type f ! -name '*.pyc' ! -path '*/__pycache__/*'
  elif [ -f "$path" ]; then
    echo "$path"
  fi
done | sort -u)
old_list=$(staged_before | sort -u)

# Files of the previous pin that the new one does not have: removed (never one of ours).
comm -23 <(echo "$old_list") <(echo "$new_list") | while read -r rel; do
  if [ -n "$rel" ] && ! tracked "$rel"; then rm -f "$root/$rel"; fi
done
# Copy: a path that is free, or that this script staged before, gets upstream's file.
staged=$(echo "$new_list" | while read -r rel; do
  dest="$root/$rel"
  if [ -e "$dest" ] && { tracked "$rel" || ! grep -qxF -- "$rel" <<<"$old_list"; }; then
    continue        # ours wins
  fi
  mkdir -p "$(dirname "$dest")"
  rm -f "$dest"
  cp "$src/$rel" "$dest"
  chmod 0644 "$dest"
  echo "$rel"
done)
{ echo "commit $commit"; echo "source $src"; echo "$staged"; } > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
echo "stage_upstream: staged upstream ${commit:0:7} from $src" >&2
