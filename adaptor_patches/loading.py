"""Loading a checkpoint through upstream's own `from_pretrained`, onto our device."""
from __future__ import annotations

from .device import Device


def load_tokenizer(model_dir):
    """The checkpoint's fast tokenizer, read directly from tokenizer.json.

    Upstream calls `AutoTokenizer.from_pretrained(dir)`, which under transformers 5 sees the
    checkpoint's `auto_map` and stops to ask whether to run remote code; the tokenizer itself is
    a plain fast tokenizer, so we load that class and hand the object to upstream.
    """
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def load_model(model_dir, device: Device, attn_impl: str = "sdpa", moe_impl: str = "eager"):
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    kwargs = dict(attn_implementation=attn_impl, torch_dtype="auto", moe_impl=moe_impl)
    if device.is_accelerator:
        kwargs["device_map"] = {"": device.torch_device}
    model = HunyuanImage3ForCausalMM.from_pretrained(str(model_dir), **kwargs)
    model.load_tokenizer(load_tokenizer(model_dir))
    return model.eval()
