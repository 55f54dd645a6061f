"""What the base model (`hunyuan_image_3/hunyuan.py`, unchanged since 62da220) needs to run on the
pipeline and image processor of the pinned upstream 1ea1526, which were rewritten for the Instruct
model (`modeling_hunyuan_image_3.py`) and no longer serve the base one. Rows of
model_adaptor.PATCHES (shims: the shims-only reference installs them too); the base model's images
are bit-identical to those it made on 62da220 (tests/test_upstream_pin.py pins the latents).

  HunyuanImage3ImageProcessor (as hunyuan.py sees it)
        1ea1526's processor asserts a base image size of at least 256 (its resolution step, base/16,
        must reach its 16-pixel alignment), requires `vit_type`, and renamed what hunyuan.py calls
        (`build_image_info`, `reso_group`). The base model gets 62da220's semantics, built on
        `tokenizer_wrapper.ResolutionGroup` / `ImageInfo`, which 1ea1526 still ships unchanged.
  HunyuanImage3ForCausalMM.prepare_inputs_for_generation
        1ea1526's denoising loop passes the timesteps as `timesteps=` (hunyuan.py reads `timestep`)
        and `input_ids=None` after the first step. hunyuan.py embeds `input_ids` at every step but,
        after the first, replaces every embedding (timestep + image tokens) and uses them only for
        the batch and length: placeholder ids of that shape stand in.
  HunyuanImage3ForCausalMM.use_taylor_cache
        1ea1526's pipeline reads this attribute of the model (upstream's own Taylor cache, an
        Instruct-model feature): False for the base model.
"""
from __future__ import annotations

import functools

import torch


class BaseModelImageProcessor:
    """The base model's image processor as 62da220 had it: generation sizes only. (62da220's
    conditioning-image preprocessing is not carried over: the base checkpoint takes no images here.)"""

    def __init__(self, config):
        from hunyuan_image_3.tokenizer_wrapper import ResolutionGroup
        self.config = config
        self.reso_group = ResolutionGroup(base_size=config.image_base_size)

    @staticmethod
    def _height_width(image_size, reso_group) -> tuple:
        """'HxW', 'H:W' or '<img_ratio_i>' (or an (H, W) pair) -> (H, W), as 62da220 parsed it."""
        if isinstance(image_size, (list, tuple)):
            if len(image_size) == 2 and all(isinstance(s, int) for s in image_size):
                return tuple(image_size)
            raise ValueError(f"`image_size` should be a tuple of two integers or 'HxW', got {image_size}.")
        if not isinstance(image_size, str):
            raise ValueError(f"`image_size` should be a tuple of two integers or 'HxW', got {image_size}.")
        if image_size.startswith("<img_ratio_"):
            reso = reso_group[int(image_size.split("_")[-1].rstrip(">"))]
            return reso.height, reso.width
        for separator in ("x", ":"):
            if separator in image_size:
                parts = [int(s) for s in image_size.split(separator)]
                if len(parts) == 2:
                    return tuple(parts)
        raise ValueError(f"`image_size` should be in the format of 'HxW', 'H:W' or <img_ratio_i>, got {image_size}.")

    def build_image_info(self, image_size):
        from hunyuan_image_3.tokenizer_wrapper import ImageInfo
        height, width = self._height_width(image_size, self.reso_group)
        image_width, image_height = self.reso_group.get_target_size(width, height)
        factor_h = self.config.vae_downsample_factor[0] * self.config.patch_size
        factor_w = self.config.vae_downsample_factor[1] * self.config.patch_size
        base_size, ratio_index = self.reso_group.get_base_size_and_ratio_index(width, height)
        return ImageInfo(image_type="gen_image", image_width=image_width, image_height=image_height,
                         token_width=image_width // factor_w, token_height=image_height // factor_h,
                         base_size=base_size, ratio_index=ratio_index)

    def preprocess(self, image):
        raise NotImplementedError("image: conditioning images need HunyuanImage-3.0-Instruct; the base checkpoint "
                                  "generates from text only")


def base_image_processor(_original, _device):
    def HunyuanImage3ImageProcessor(config):       # noqa: N802 (the name hunyuan.py calls)
        return BaseModelImageProcessor(config)
    return HunyuanImage3ImageProcessor


def prepare_inputs_for_new_pipeline(original, _device):
    @functools.wraps(original)
    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        if "timesteps" in kwargs and kwargs.get("timestep") is None:
            kwargs["timestep"] = kwargs.pop("timesteps")
        if input_ids is None and kwargs.get("mode") == "gen_image":
            position_ids = kwargs["position_ids"]
            input_ids = torch.zeros(position_ids.shape, dtype=torch.long, device=position_ids.device)
        return original(self, input_ids, *args, **kwargs)

    return prepare_inputs_for_generation


def no_taylor_cache(_original, _device):
    return property(lambda _self: False)
