"""The tiny HunyuanImage-3.0-Instruct and Instruct-Distil checkpoints (utils/make_tiny_model.py
--instruct / --distil): what their config files hold beyond the base tiny model's, and why.

The released Instruct config files are not available here; each value below is read from upstream's
code at 1ea1526 (configuration_hunyuan_image_3.py, modeling_hunyuan_image_3.py, image_processor.py,
tokenization_hunyuan_image_3.py), its README / Hunyuan-Image3.md / run_demo_instruct*.sh, and the
published generation_config.json of Instruct-Distil (config/real_model/SOURCES.md, section 4):

  config.json
    cfg_distilled, use_meanflow   Distil: true, true (its pipeline: one CFG branch, a guidance token,
                                  a meanflow `timesteps_r` token); Instruct: false, false
    model_version                 "HunyuanImage-3.0-Instruct" (the class default; the tokenizer treats
                                  every value but "HunyuanImage-3.0" alike) / "...-Instruct-Distil"
    vit_type                      "siglip2-so400m-patch16-naflex": the only one the image processor builds
    vae_type                      "hunyuan-image-vae-v1"; vae_dtype float32, vae_autocast_dtype float16
                                  (class defaults; the published base config.json carries the same)
    cond_image_type "vae_vit", cond_token_attn_type "joint_full", rope_type "2d": as the published
                                  config.json (possibly the January refresh, see SOURCES.md) has them;
                                  a conditioning image is VAE latents + SigLIP2 tokens, one full-attention block
    image_base_size               256, the smallest the Instruct image processor builds (real: 1024)
    vit.vision_use_head           true, as the released checkpoint (its pooling head is stored, unused);
                                  output_attentions / output_hidden_states false, use_return_dict true
                                  (siglip2.py reads them; the released vit block has them)
  generation_config.json          the published Instruct-Distil values: sequence_template "instruct",
                                  use_system_prompt "en_unified", bot_task "think_recaption",
                                  diff_guidance_scale 2.5, max_length 22800, max_new_tokens 2048,
                                  diff_infer_steps 8; Instruct the same with 50 steps (the README:
                                  Distil keeps "all other recommended parameter values unchanged")
  tokenizer                       the base tiny BPE plus every special token the Instruct tokenizer
                                  looks up (<timestep_r>, <boa>/<eoa>, ..., <img_ratio_33..36>);
                                  tokenizer_config.json in transformers 4's form (additional_special_tokens),
                                  as a release written by 4.x has it, so 4.57.1 loads it too

Conditioning paths. At plain random init a tiny model's image barely depends on what conditions
it: zeroing the guidance or meanflow token, the SigLIP2 tokens or the VAE latents of a conditioning
image each moved the 256x256 image by less than the full adaptor differs from upstream eager (55-60
dB PSNR both), so an equivalence test could not tell a dropped path from kernel noise. Scaling a
path's own tensors does not help: every token is RMS-normalised before attention and queries / keys
again per head (qk-norm), so only attention can carry a token's influence. `shape_attention` makes it:
  - every o_proj x ATTENTION_GAIN (as tests/conftest.gained_model does for the base model);
  - Distil only, "marker" channels: the guidance / meanflow embedders' output row of a residual
    channel of its own is MARKER_GAIN times larger (so that channel carries a good part of the
    token, and how much depends on the guidance / `timesteps_r` value), every layer's key reads that
    channel into two head dims of its own (MARKER_KEY), and qk-norm weighs those head dims
    MARKER_SHARPNESS times: those tokens' keys stand out with their value, and removing one, or
    feeding it another value, moves the image tokens that attend to it.
    (The markers sharpen attention for every token a little: on the Instruct checkpoint, which has
    no such token, they only added kernel noise, 54.8 -> 42.1 dB, so it has o_proj's gain alone.)
Measured (one conditioning image at 256x256, tests/test_instruct.py prints it): Instruct (2 steps):
full adaptor vs upstream eager 54.6 dB (final latents 7.5e-3 apart); zeroing the SigLIP2 tokens 38.9 dB
(7.7e-2), the VAE encoder 35.4 (1.1e-1). Distil (3 steps): full vs eager 52.7 dB (1.1e-2); zeroing
the guidance token 39.8 dB (6.4e-2), the meanflow token 38.4 (7.7e-2), the SigLIP2 tokens 32.1, the
VAE encoder 29.3; the meanflow token fed the timestep instead of `timesteps_r` 38.1 dB (8.0e-2).
Sharper markers move those tokens' images further but the kernel noise too (MARKER_SHARPNESS 6:
46.2 dB / 3.0e-2 between full and eager). A constant marker (a bias instead of a row gain) made the
tokens matter but not their value: `timesteps_r` replaced by the timestep passed at 52.6 dB.
"""
from __future__ import annotations

DEFAULTS = dict(image_base_size=256)
MIN_BASE_SIZE = 256
EXTRA_SPECIAL_TOKENS = ("<boa>", "<eoa>", "<bov>", "<eov>", "<audio>", "<video>", "<timestep_r>",
                        "<ref>", "</ref>", "<quad>", "</quad>", *(f"<img_ratio_{i}>" for i in range(33, 37)))
MAX_LENGTH = 22800

ATTENTION_GAIN = 32.0
MARKER_GAIN = 40.0
MARKER_KEY = 1.0
MARKER_SHARPNESS = 4.0
# embedder -> (residual channel, the two head dims its key lands in: a rotate-half pair)
MARKERS = {"guidance_emb": (0, (15, 31)), "timestep_r_emb": (1, (7, 23))}


# The text phase: a decisive LM head (as harness/checkpoints.py gives the base tiny model), and the
# rows of the tokens that end a think / recaption section scaled further, so that a tiny model's
# think_recaption reaches its ratio token in a few tokens (upstream raises when the call ends anywhere else).
LM_HEAD_GAIN = 4.0
END_TOKEN_GAIN = 5.0
END_TOKENS = ("</think>", "</recaption>")


def shape_attention(state: dict, config) -> None:
    """The attention edits of the module docstring, in place on the bf16 `state`."""
    import torch
    kv, head_dim = config.num_key_value_heads, config.attention_head_dim
    groups = config.num_attention_heads // kv
    markers = {e: m for e, m in MARKERS.items() if f"{e}.mlp.2.bias" in state}     # Distil's embedders only
    dims = [d for _, pair in markers.values() for d in pair]

    def edit(name, change):
        weight = state[name].float()
        change(weight)
        state[name] = weight.to(torch.bfloat16).contiguous()

    def sharpen(weight):
        weight[dims] *= MARKER_SHARPNESS

    def mark_keys(weight):
        per_head = weight.view(kv, groups + 2, head_dim, -1)      # upstream's interleaved q.. | k | v rows
        for channel, pair in markers.values():
            per_head[:, groups, list(pair), channel] = MARKER_KEY

    for name in list(state):
        if name.endswith("self_attn.o_proj.weight"):
            edit(name, lambda w: w.mul_(ATTENTION_GAIN))
        elif markers and name.endswith("self_attn.qkv_proj.weight"):
            edit(name, mark_keys)
        elif markers and name.endswith(("self_attn.query_layernorm.weight", "self_attn.key_layernorm.weight")):
            edit(name, sharpen)
    for embedder, (channel, _) in markers.items():
        edit(f"{embedder}.mlp.2.weight", lambda w, c=channel: w[c].mul_(MARKER_GAIN))


def scale_lm_head(state: dict, tokenizer) -> None:
    """lm_head.weight (bf16, in place in `state`) times LM_HEAD_GAIN, END_TOKENS' rows END_TOKEN_GAIN more."""
    weight = state["lm_head.weight"].float() * LM_HEAD_GAIN
    weight[tokenizer.convert_tokens_to_ids(list(END_TOKENS))] *= END_TOKEN_GAIN
    state["lm_head.weight"] = weight.to(state["lm_head.weight"].dtype)


def configure(config, distil: bool) -> None:
    """The Instruct keys on a config built like the base tiny one (make_tiny_model.build_config)."""
    config.cfg_distilled = config.use_meanflow = distil
    config.model_version = "HunyuanImage-3.0-Instruct-Distil" if distil else "HunyuanImage-3.0-Instruct"
    config.vit_type = "siglip2-so400m-patch16-naflex"
    config.vae_type = "hunyuan-image-vae-v1"
    config.vae_dtype, config.vae_autocast_dtype = "float32", "float16"
    config.cond_image_type, config.cond_token_attn_type, config.rope_type = "vae_vit", "joint_full", "2d"
    config.max_position_embeddings = MAX_LENGTH
    # as the released config.json's vit block has them (siglip2.py reads them; the base tiny never runs the ViT)
    config.vit.update(vision_use_head=True, output_attentions=False, output_hidden_states=False, use_return_dict=True)


def tokenizer_config(written: dict) -> dict:
    """tokenizer_config.json as a transformers 4 release writes it (transformers 5 writes its special
    tokens as `extra_special_tokens`, a list 4.57.1 cannot read): the reference run on upstream's
    own pin (transformers 4.57.1) loads the same files."""
    keys = ("bos_token", "eos_token", "pad_token", "model_max_length", "tokenizer_class", "clean_up_tokenization_spaces")
    config = {key: written[key] for key in keys if key in written}
    return {**config, "additional_special_tokens": list(written.get("extra_special_tokens", []))}


def generation_config(tokenizer, distil: bool) -> dict:
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.6, top_k=1024, top_p=0.95,
        max_length=MAX_LENGTH, max_new_tokens=2048, sequence_template="instruct",
        diff_infer_steps=8 if distil else 50, diff_guidance_scale=2.5, flow_shift=3.0,
        use_system_prompt="en_unified", bot_task="think_recaption", drop_think=False,
    )
