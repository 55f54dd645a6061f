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
    vit.vision_use_head           true, as the released checkpoint (its pooling head is stored, unused)
  generation_config.json          the published Instruct-Distil values: sequence_template "instruct",
                                  use_system_prompt "en_unified", bot_task "think_recaption",
                                  diff_guidance_scale 2.5, max_length 22800, max_new_tokens 2048,
                                  diff_infer_steps 8; Instruct the same with 50 steps (the README:
                                  Distil keeps "all other recommended parameter values unchanged")
  tokenizer                       the base tiny BPE plus every special token the Instruct tokenizer
                                  looks up (<timestep_r>, <boa>/<eoa>, ..., <img_ratio_33..36>)

Conditioning paths. At plain random init a tiny model's image barely depends on what conditions
it: zeroing the guidance token moved the image less than a change of attention kernel does, so a
test could not tell a dropped path from kernel noise. The tensors that write each path into the
residual stream are scaled (GAINS) so that removing any one moves the image far more
(tests/test_instruct.py measures it): the VAE latents of a conditioning image (the VAE encoder's
output), its SigLIP2 tokens (the aligner's last layer), the guidance token and the meanflow
`timesteps_r` token (their embedders' last layers).
"""
from __future__ import annotations

DEFAULTS = dict(image_base_size=256)
MIN_BASE_SIZE = 256
EXTRA_SPECIAL_TOKENS = ("<boa>", "<eoa>", "<bov>", "<eov>", "<audio>", "<video>", "<timestep_r>",
                        "<ref>", "</ref>", "<quad>", "</quad>", *(f"<img_ratio_{i}>" for i in range(33, 37)))
MAX_LENGTH = 22800

# tensor name prefix -> gain (see the module docstring)
GAINS = {}


def gain_of(name: str) -> float:
    return next((gain for prefix, gain in GAINS.items() if name.startswith(prefix)), 1)


def configure(config, distil: bool) -> None:
    """The Instruct keys on a config built like the base tiny one (make_tiny_model.build_config)."""
    config.cfg_distilled = config.use_meanflow = distil
    config.model_version = "HunyuanImage-3.0-Instruct-Distil" if distil else "HunyuanImage-3.0-Instruct"
    config.vit_type = "siglip2-so400m-patch16-naflex"
    config.vae_type = "hunyuan-image-vae-v1"
    config.vae_dtype, config.vae_autocast_dtype = "float32", "float16"
    config.cond_image_type, config.cond_token_attn_type, config.rope_type = "vae_vit", "joint_full", "2d"
    config.max_position_embeddings = MAX_LENGTH
    config.vit["vision_use_head"] = True


def generation_config(tokenizer, distil: bool) -> dict:
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.6, top_k=1024, top_p=0.95,
        max_length=MAX_LENGTH, max_new_tokens=2048, sequence_template="instruct",
        diff_infer_steps=8 if distil else 50, diff_guidance_scale=2.5, flow_shift=3.0,
        use_system_prompt="en_unified", bot_task="think_recaption", drop_think=False,
    )
