"""The project's tools and run-time packages (utils.runtime, utils.launcher, ...) — and, lazily, the two
names upstream's `hunyuan_image_3/__init__.py` imports from its own top-level `utils` package:

    from utils import _LazyModule
    from utils.import_utils import define_import_structure

Upstream's `utils/import_utils.py` is staged beside this file (utils/stage_upstream.sh, git-ignored);
upstream's `utils/__init__.py` is not (this file is ours). The names resolve on first access only, so
`import utils.runtime.engine.rank_console` stays as light as before: entry points route their console before
transformers (or anything upstream) is imported.
"""

_UPSTREAM_NAMES = ("_LazyModule", "define_import_structure")


def __getattr__(name):
    if name in _UPSTREAM_NAMES:
        from . import import_utils      # upstream's, staged
        return getattr(import_utils, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
