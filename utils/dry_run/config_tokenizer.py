"""The tokenizer of a dry run: the checkpoint's own where it has one, else one made for the config.

config/real_model and config/real_instruct hold the published configs only. A fake model needs
token ids, not words: the tokenizer made here is the tiny model's byte-level BPE (utils/make_tiny_model)
trained the same way, with the special tokens the pipeline looks up by name at the ids the config
gives them, padded to the config's vocabulary. Written once per config into .cache/dry_run/.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tokenizer_dir(model_dir: Path) -> Path:
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    raise FileNotFoundError(f"model-id: {model_dir} has no tokenizer.json; a dry run of a config-only folder "
                            f"needs one beside config.json")
