"""Write a small random HunyuanImage-3.0 checkpoint that upstream's own loader accepts.

    python utils/make_tiny_model.py --out DIR [--instruct | --distil] [--layers 2 --hidden 128 ...] [--overwrite]

The weights are the state_dict of upstream's own module tree (random init, every all-zero tensor
re-randomised), saved as bf16 safetensors shards with an index. The tokenizer is a byte-level BPE
trained here on upstream's system prompts, carrying the special tokens upstream looks up.
config.json has no `auto_map`: with one, transformers 5's AutoTokenizer asks on stdin whether to
trust remote code that this directory does not contain.

--instruct / --distil write HunyuanImage-3.0-Instruct / -Instruct-Distil checkpoints with upstream's
Instruct classes (modeling_hunyuan_image_3.py): utils/tiny_instruct.py says what their config files
hold, where each value comes from, and how the conditioning paths are scaled.
"""
import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":      # run by its documented path (python utils/make_tiny_model.py): Python puts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # utils/, not the project root, on sys.path

DEFAULTS = dict(
    layers=2, hidden=128, heads=4, kv_heads=2, head_dim=None, experts=4, topk=2,
    moe_intermediate=None, patch_embed_dim=64, image_base_size=64, vocab_extra=16,
    seed=0, num_shards=3,
)
VARIANTS = ("base", "instruct", "distil")
POSITIVE = ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "topk", "moe_intermediate",
            "patch_embed_dim", "image_base_size", "num_shards")
BPE_VOCAB = 512
NUM_RATIOS = 33
INIT_STD = 0.02
BOS, EOS, PAD = "<|startoftext|>", "<|endoftext|>", "<pad>"
SPECIAL_TOKENS = (
    "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<guidance>", "<joint_img_sep>",
    "<answer>", "</answer>", "<think>", "</think>", "<recaption>", "</recaption>",
)
TRAIN_TEXT = (
    "A brown and white dog is running on the grass.",
    "A red apple on a wooden table, soft morning light, photorealistic.",
    "A watercolor painting of a lighthouse at sunset with seagulls.",
    "User: draw a cat wearing a tiny hat\n\nAssistant: ",
)


class SizeError(ValueError):
    """A bad size or path; `field` names the flag at fault."""

    def __init__(self, field, message):
        super().__init__(f"{field}: {message}")
        self.field = field


def resolve_sizes(variant="base", **sizes):
    """Defaults filled in, derived sizes resolved, every constraint upstream has checked."""
    from utils import tiny_instruct
    unknown = sorted(set(sizes) - set(DEFAULTS))
    if unknown:
        raise SizeError(unknown[0], f"unknown size; known: {', '.join(DEFAULTS)}")
    if variant not in VARIANTS:
        raise SizeError("variant", f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    defaults = DEFAULTS if variant == "base" else {**DEFAULTS, **tiny_instruct.DEFAULTS}
    s = {**defaults, **{k: v for k, v in sizes.items() if v is not None}}
    for field, value in s.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise SizeError(field, f"must be an integer, got {value!r}")
    for field in POSITIVE:
        if s[field] is not None and s[field] < 1:
            raise SizeError(field, f"must be >= 1, got {s[field]}")
    if s["vocab_extra"] < 0:
        raise SizeError("vocab_extra", f"must be >= 0, got {s['vocab_extra']}")
    for field in ("hidden", "patch_embed_dim"):
        if s[field] % 32:
            raise SizeError(field, f"{s[field]} is not a multiple of 32 (GroupNorm(32) runs over it); "
                                   f"use {32 * max(1, round(s[field] / 32))}")
    if s["head_dim"] is None:
        if s["hidden"] % s["heads"]:
            raise SizeError("heads", f"{s['heads']} does not divide hidden {s['hidden']}; "
                                     f"use a divisor or pass --head-dim")
        s["head_dim"] = s["hidden"] // s["heads"]
    if s["head_dim"] % 4:
        raise SizeError("head_dim", f"{s['head_dim']} is not a multiple of 4 (2-D rotary "
                                    f"splits it in quarters); change --heads or pass --head-dim")
    if s["heads"] % s["kv_heads"]:
        raise SizeError("kv_heads", f"{s['kv_heads']} does not divide heads {s['heads']}; use a divisor")
    if s["topk"] > s["experts"]:
        raise SizeError("topk", f"{s['topk']} exceeds experts {s['experts']}; use topk <= experts")
    if s["moe_intermediate"] is None:
        s["moe_intermediate"] = s["hidden"]
    if s["image_base_size"] % 16 or s["image_base_size"] < 32:
        raise SizeError("image_base_size", f"{s['image_base_size']} must be a multiple of 16 (the VAE "
                                           f"downsamples by 16) and >= 32; use 64")
    if variant != "base" and s["image_base_size"] < tiny_instruct.MIN_BASE_SIZE:
        raise SizeError("image_base_size", f"{s['image_base_size']} is below {tiny_instruct.MIN_BASE_SIZE}, the "
                                           f"smallest base size upstream's Instruct image processor builds (its "
                                           f"resolution step, base/16, must reach its 16-pixel alignment); use "
                                           f"{tiny_instruct.MIN_BASE_SIZE}")
    return {**s, "variant": variant}


def import_upstream(variant="base"):
    """Upstream's config and model classes (staged by utils/stage_upstream.sh)."""
    if variant != "base":
        from hunyuan_image_3.configuration_hunyuan_image_3 import HunyuanImage3Config
        from hunyuan_image_3.modeling_hunyuan_image_3 import HunyuanImage3ForCausalMM
        return HunyuanImage3Config, HunyuanImage3ForCausalMM
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    return HunyuanImage3Config, HunyuanImage3ForCausalMM


def build_tokenizer(image_base_size, extra_special_tokens=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hunyuan_image_3.system_prompt import t2i_system_prompts

    corpus = list(TRAIN_TEXT) + [p for prompts in t2i_system_prompts.values() for p in prompts if p]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    added = [*SPECIAL_TOKENS, f"<img_size_{image_base_size}>", *(f"<img_ratio_{i}>" for i in range(NUM_RATIOS)),
             *extra_special_tokens]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=added, model_max_length=12800,
    )


def sub_configs(s):
    vit_hidden = 32
    return dict(
        vae=dict(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 32, 64, 64, 64],
            layers_per_block=1, ffactor_spatial=16, ffactor_temporal=4, sample_size=s["image_base_size"],
            sample_tsize=16, scaling_factor=0.75, shift_factor=None,
            downsample_match_channel=True, upsample_match_channel=True,
        ),
        vit=dict(
            hidden_size=vit_hidden, intermediate_size=2 * vit_hidden, num_attention_heads=2,
            num_hidden_layers=1, num_channels=3, patch_size=16, num_patches=16,
            hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, attention_dropout=0.0,
            vision_use_head=False, _attn_implementation="sdpa",
        ),
        vit_processor=dict(
            image_processor_type="Siglip2ImageProcessorFast", patch_size=16, max_num_patches=16,
            do_resize=True, resample=2, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        ),
        vit_aligner=dict(projector_type="mlp_gelu", input_dim=vit_hidden, n_embed=s["hidden"], depth=2),
    )


def build_config(config_cls, s, tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    config = config_cls(
        vocab_size=len(tokenizer) + s["vocab_extra"], hidden_size=s["hidden"],
        intermediate_size=s["moe_intermediate"], moe_intermediate_size=s["moe_intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        attention_head_dim=s["head_dim"], num_experts=s["experts"], moe_topk=s["topk"],
        use_mixed_mlp_moe=True, num_shared_expert=1, moe_drop_tokens=False, use_qk_norm=True,
        rope_scaling={"type": "custom"}, rope_theta=10000.0, max_position_embeddings=12800,
        patch_embed_hidden_dim=s["patch_embed_dim"], image_base_size=s["image_base_size"],
        pad_token_id=ids(PAD), bos_token_id=ids(BOS), eos_token_id=ids(EOS), image_token_id=ids("<img>"),
        architectures=["HunyuanImage3ForCausalMM"], **sub_configs(s),
    )
    config._attn_implementation = "sdpa"
    return config


def config_json(config):
    """The config as upstream's own config.json spells it (transformers 5 renames two keys)."""
    d = config.to_dict()
    d.pop("rope_parameters", None)
    d.update(rope_scaling={"type": "custom"}, torch_dtype="bfloat16", dtype="bfloat16")
    return d


def generation_config(tokenizer):
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.6, top_k=1024, top_p=0.95,
        max_length=12800, sequence_template="pretrain", diff_infer_steps=2, diff_guidance_scale=5.0,
        flow_shift=3.0, use_system_prompt="en_vanilla", bot_task="image", drop_think=False,
    )


def build_state_dict(model_cls, config, seed):
    """Upstream's module tree at random init, all-zero tensors re-randomised, in bf16. Built under the adaptor's shims only (upstream's VAE allocates on CUDA
    in its __init__; 1ea1526's image processor no longer serves the base model)."""
    import torch

    import model_adaptor
    with model_adaptor.applied("cpu", shims_only=True):
        torch.manual_seed(seed)
        model = model_cls(config)
    generator = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not tensor.any():
            tensor = torch.randn(tensor.shape, generator=generator) * INIT_STD
        state[name] = tensor.detach().to(torch.bfloat16).contiguous()
    return state


def split_shards(state, num_shards):
    """Contiguous groups of names, balanced by bytes, none empty."""
    if num_shards > len(state):
        raise SizeError("num_shards", f"{num_shards} exceeds the {len(state)} tensors; use fewer shards")
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards, done = [[]], 0
    for i, (name, tensor) in enumerate(state.items()):
        due = done >= total * len(shards) / num_shards or len(state) - i == num_shards - len(shards)
        if shards[-1] and len(shards) < num_shards and due:
            shards.append([])
        shards[-1].append(name)
        done += tensor.numel() * tensor.element_size()
    return shards, total


def write_shards(state, out, num_shards):
    from safetensors.torch import save_file

    shards, total = split_shards(state, num_shards)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def verify_shards(out):
    """Read the shards back: every tensor bf16, no floating tensor all zero."""
    import torch
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.dtype != torch.bfloat16:
                    raise RuntimeError(f"{file}: {name} is {tensor.dtype}, expected bfloat16")
                if not tensor.any():
                    raise RuntimeError(f"{file}: {name} is all zero")


def write_checkpoint(out, s):
    from utils import tiny_instruct
    variant = s["variant"]
    config_cls, model_cls = import_upstream(variant)
    if variant == "base":
        tokenizer = build_tokenizer(s["image_base_size"])
        config = build_config(config_cls, s, tokenizer)
        gen_config = generation_config(tokenizer)
    else:
        tokenizer = build_tokenizer(s["image_base_size"], tiny_instruct.EXTRA_SPECIAL_TOKENS)
        config = build_config(config_cls, s, tokenizer)
        tiny_instruct.configure(config, distil=variant == "distil")
        gen_config = tiny_instruct.generation_config(tokenizer, variant == "distil")
    state = build_state_dict(model_cls, config, s["seed"])
    if variant != "base":
        tiny_instruct.shape_attention(state, config)
        tiny_instruct.scale_lm_head(state, tokenizer)
    out.mkdir(parents=True)
    tokenizer.save_pretrained(str(out))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if variant != "base":
        tokenizer_config = tiny_instruct.tokenizer_config(tokenizer_config)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_json(config), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    total = write_shards(state, out, s["num_shards"])
    verify_shards(out)
    return sum(t.numel() for t in state.values()), total


def make_tiny_model(out_dir, overwrite=False, variant="base", **sizes):
    """Write the checkpoint to `out_dir` atomically; return its path. Raises SizeError on bad input.
    variant: "base", "instruct" or "distil" (VARIANTS)."""
    return _make(out_dir, overwrite, variant, **sizes)[0]


def ensure_tiny_model(out_dir, variant="base", **sizes) -> Path:
    """`out_dir` as a tiny checkpoint, written first when it holds no config.json yet (the benchmarks'
    and the self-check's models): by this file run as a program, in a fresh interpreter, since a
    process that applied the adaptor would write its patched module tree, not upstream's. Its path;
    RuntimeError with the tool's last line when it fails."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    flags = [] if variant == "base" else [f"--{variant}"]
    for name, value in sizes.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    print(f"building the tiny {variant} checkpoint at {out} ...", file=sys.stderr, flush=True)
    import subprocess
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", str(out), *flags],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()] or ["no output"]
        raise RuntimeError(f"utils/make_tiny_model.py failed (exit {proc.returncode}): {lines[-1][:200]}")
    return out


def _make(out_dir, overwrite=False, variant="base", **sizes):
    s = resolve_sizes(variant, **sizes)
    out = Path(out_dir).absolute()
    if out.exists() and not (overwrite and out.is_dir()):
        raise SizeError("out", f"{out} already exists; pass --overwrite (directories only) or pick a new path")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        params, total = write_checkpoint(tmp, s)
        if out.exists():
            _swap(tmp, out, old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, params, total, s


def _swap(new, out, old):
    out.rename(old)
    try:
        new.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        if message.startswith("the following arguments are required"):
            message = "out: required; pass --out DIR"
        elif message.startswith("unrecognized arguments"):
            message = f"arguments: {message}; see --help"
        print(f"error: {message.replace('argument --', '')}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv):
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--instruct", dest="variant", action="store_const", const="instruct", default="base",
                      help="a HunyuanImage-3.0-Instruct checkpoint (image base size 256)")
    kind.add_argument("--distil", dest="variant", action="store_const", const="distil",
                      help="a HunyuanImage-3.0-Instruct-Distil checkpoint (guidance and meanflow tokens)")
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                       help=f"default {default if default is not None else 'derived'}")
    return p.parse_args(argv)


def main(argv=None):
    args = vars(parse_args(argv))
    out, overwrite, variant = args.pop("out"), args.pop("overwrite"), args.pop("variant")
    try:
        path, params, total, s = _make(out, overwrite, variant, **args)
    except SizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({variant}): {params:,} params, {total:,} bytes in {s['num_shards']} bf16 shards "
          f"(layers {s['layers']}, hidden {s['hidden']}, experts {s['experts']} top-{s['topk']})")
    return 0


def _quiet():
    """Upstream under transformers 5 warns about deprecations at every import; the CLI keeps one line."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


if __name__ == "__main__":
    _quiet()
    sys.exit(main())
