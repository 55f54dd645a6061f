"""The tokenizer of a dry run: the checkpoint's own where it has one, else a stand-in made for the config.

config/real_model and config/real_instruct hold the published configs only (no tokenizer, no weights).
A fake model needs token ids, not words, so the stand-in is honest about what it is:
  - its words are the tiny model's byte-level BPE (utils/make_tiny_model.build_tokenizer: 512 tokens
    trained on a few captions and upstream's system prompts), so a prompt takes more tokens than under
    the real tokenizer (a few per word); the image's tokens, which set the step's size, do not change;
  - the tokens the config names by id sit at those ids: eos / bos / pad, `<img>` (image_token_id),
    `<boi>` / `<eoi>` (im_start_id / im_end_id); the config's other ids (text_start_id, eod_token_id,
    ...) hold placeholder tokens named after their key, so no id the model may meet is unknown;
  - the special tokens the pipeline looks up by name (`<img_size_1024>`, `<img_ratio_N>`, `<think>`,
    `<recaption>`, ...) follow the config's last named id (the real tokenizer's special range), the
    BPE's words take the ids from 0 up around the config's small ids; all below the config's vocab_size.
A folder without generation_config.json (config/real_instruct) gets the tiny model's, with the config's
ids (and its max_position_embeddings as max_length). Written once per config under res/dry_run/
(git-ignored), named after the folder and a digest of its config.json, with a copy of config.json: the
dry run's job names that folder (its checks read the generation config there).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "res" / "dry_run" / "tokenizers"
NAMED_IDS = {"eos_token_id": "EOS", "bos_token_id": "BOS", "pad_token_id": "PAD", "image_token_id": "<img>",
             "im_start_id": "<boi>", "im_end_id": "<eoi>"}          # config key -> the token the id names
PLACEHOLDER_IDS = ("eod_token_id", "text_start_id", "text_end_id", "video_start_id", "video_end_id",
                   "im_newline_id", "mask_init_id", "pad_id")


def tokenizer_dir(model_dir: Path) -> Path:
    """Where a dry run reads the tokenizer and generation config of `model_dir`."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    config_bytes = (model_dir / "config.json").read_bytes()
    out = CACHE / f"{model_dir.resolve().name}-{hashlib.sha256(config_bytes).hexdigest()[:12]}"
    if all((out / name).is_file() for name in ("tokenizer.json", "generation_config.json", "config.json")):
        return out
    staging = Path(tempfile.mkdtemp(prefix="tokenizer-", dir=_made(CACHE)))
    write_stand_in(model_dir, json.loads(config_bytes), staging)
    if out.exists():                        # another process wrote it meanwhile
        shutil.rmtree(staging)
    else:
        staging.rename(out)
    return out


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_stand_in(model_dir: Path, config: dict, out: Path) -> None:
    from utils import make_tiny_model as tiny
    from utils import tiny_instruct
    instruct = "modeling_hunyuan_image_3" in json.dumps(config.get("auto_map", {}))
    tokenizer = tiny.build_tokenizer(config.get("image_base_size", 1024),
                                     tiny_instruct.EXTRA_SPECIAL_TOKENS if instruct else ())
    tokenizer.save_pretrained(str(out))
    names = {"EOS": tiny.EOS, "BOS": tiny.BOS, "PAD": tiny.PAD}
    fixed = {int(config[key]): names.get(name, name) for key, name in NAMED_IDS.items() if key in config}
    for key in PLACEHOLDER_IDS:
        if key in config and int(config[key]) not in fixed:
            fixed[int(config[key])] = f"<|{key}|>"
    remap = renumber(json.loads((out / "tokenizer.json").read_text()), fixed, int(config["vocab_size"]))
    data, old_to_new = remap
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    decoder = settings.pop("added_tokens_decoder", None)
    if decoder is not None:
        settings["added_tokens_decoder"] = {str(old_to_new[int(k)]): v for k, v in decoder.items()}
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    if instruct:
        settings = tiny_instruct.tokenizer_config(settings)
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    shutil.copyfile(model_dir / "config.json", out / "config.json")       # the folder the dry run's job names
    if (model_dir / "generation_config.json").is_file():
        shutil.copyfile(model_dir / "generation_config.json", out / "generation_config.json")
    else:
        (out / "generation_config.json").write_text(json.dumps(generation_config(config, instruct), indent=2) + "\n")


def renumber(data: dict, fixed: dict, vocab_size: int) -> tuple:
    """tokenizer.json's ids moved: `fixed` {id: token} first (placeholders added where the tokenizer has
    no such token), the BPE's words from 0 up around them, the other added tokens after the largest
    fixed id. (data, {old id: new id})."""
    vocab = data["model"]["vocab"]
    added = data["added_tokens"]
    at = {token: i for i, token in fixed.items()}
    template = dict(added[0], special=True) if added else {"single_word": False, "lstrip": False, "rstrip": False,
                                                             "normalized": False, "special": True}
    for token in at:
        if not any(a["content"] == token for a in added):
            added.append({**template, "id": -1, "content": token})
    is_added = {a["content"] for a in added}
    free_low = (i for i in range(vocab_size) if i not in fixed)
    free_high = (i for i in range(max(fixed) + 1, vocab_size) if i not in fixed)
    old_to_new, new_of = {}, {}
    for token, old in sorted(vocab.items(), key=lambda kv: kv[1]):
        new_of[token] = at.get(token, next(free_high) if token in is_added else next(free_low))
        old_to_new[old] = new_of[token]
    for entry in added:
        if entry["content"] not in new_of:
            new_of[entry["content"]] = at.get(entry["content"], next(free_high))
        if entry["id"] >= 0:
            old_to_new[entry["id"]] = new_of[entry["content"]]
        entry["id"] = new_of[entry["content"]]
    data["model"]["vocab"] = {token: new_of[token] for token in [*vocab, *(a["content"] for a in added)]}   # (tokenizers
    # numbers an added token the model's vocab lacks after the vocab, whatever id it was saved with)
    data["added_tokens"] = sorted(added, key=lambda a: a["id"])
    if max(new_of.values()) >= vocab_size:
        raise ValueError(f"model-id: the stand-in tokenizer needs {max(new_of.values()) + 1} ids, the config's "
                         f"vocab_size is {vocab_size}")
    return data, old_to_new


def generation_config(config: dict, instruct: bool) -> dict:
    """The tiny model's generation settings (utils/make_tiny_model, utils/tiny_instruct) with the config's ids."""
    ids = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
           "pad_token_id": config.get("pad_token_id")}
    common = dict(do_sample=True, temperature=0.6, top_k=1024, top_p=0.95, flow_shift=3.0, drop_think=False,
                  max_length=config.get("max_position_embeddings", 12800))
    if instruct:
        return {**ids, **common, "max_new_tokens": 2048, "sequence_template": "instruct", "diff_infer_steps": 50,
                "diff_guidance_scale": 2.5, "use_system_prompt": "en_unified", "bot_task": "think_recaption"}
    return {**ids, **common, "sequence_template": "pretrain", "diff_infer_steps": 50, "diff_guidance_scale": 5.0,
            "use_system_prompt": "None", "bot_task": "image"}
