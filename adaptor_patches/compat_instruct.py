"""What upstream's Instruct model (`hunyuan_image_3/modeling_hunyuan_image_3.py`, 1ea1526) needs on
transformers 5, and the one flag its image path drops. Rows of model_adaptor.PATCHES (shims: the
shims-only reference installs them too). The shims it shares with the base model (device-neutral
`torch`, nvtx, the static cache, `_init_weights`, the VAE's dtype) are compat.py's functions.

  HunyuanImage3ForCausalMM.load_tokenizer
        Upstream builds `HunyuanImage3TokenizerFast.from_pretrained(dir)`, a PreTrainedTokenizerFast
        subclass. transformers 5 (5.2 and 5.23 alike) rebuilds such a class's BPE model from the
        vocabulary of tokenizer.json without its merges and byte-level pre-tokenizer: every prompt
        becomes single characters, spaces and unknown characters dropped, silently, and the image
        lands 27 dB from transformers 4.57.1's (tiny Instruct, text-to-image; docs/COMPAT.md). Here the class is built around the
        `tokenizers` backend read from tokenizer.json itself, as 4.57.1 does, with the checkpoint's
        tokenizer_config.json applied by transformers as before (model_version passed as upstream does).
  HunyuanImage3ImageProcessor.__init__ (image_processor.py)
        transformers 5.3+'s Siglip2ImageProcessorFast returns Python lists unless asked for tensors
        (5.2 and 4.57.1 returned tensors); upstream calls it without asking and then `.squeeze(0)`s
        the result. Its SigLIP2 processor is asked for tensors ("pt").
  _prepare_4d_attention_mask (as siglip2.py imported it)
        transformers 5.2.0's version logs its deprecation warning with a stray argument, a logging
        error (a traceback on the console, a failure under pytest) at the first SigLIP2 forward.
        Here the same mask, without the call: [batch, keys] 1 / 0 -> [batch, 1, queries, keys],
        0 where attended and the dtype's minimum where not.
  decomposition_FFT, reconstruction (cache_utils.py)
        Upstream's own Taylor cache (generate_image(use_taylor_cache=True); the CLI's --use-taylor-cache
        runs ours instead, utils/runtime/requests/upstream_taylor.py) splits each hidden state by an FFT in two
        `torch.compile`d functions. Inductor needs a C++ toolchain on the CPU and took ~35 s at the
        first cached image here; on an NPU it is not the backend this project runs. The same functions
        run eagerly (the same ops: an fp32 FFT and its inverse), so the reference runs anywhere.
  HunyuanImage3Text2ImagePipeline.__call__
        The Instruct model's `generate` hands the pipeline its generation config's
        `diff_infer_steps` / `diff_guidance_scale` only; `generate_image(diff_infer_steps=8)` (upstream's
        own `--diff-infer-steps`) reached the pipeline in `model_kwargs` and was ignored. Given there,
        they now decide, as they do for the base model (whose `generate` already passes the same values).
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_with_merges(tokenizer_cls, model_dir, **kwargs):
    """`tokenizer_cls.from_pretrained(model_dir, **kwargs)` with the fast backend read from the
    directory's tokenizer.json (its BPE merges kept)."""
    from tokenizers import Tokenizer
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model-id: {model_dir} has no {TOKENIZER_FILE}; the Instruct tokenizer is read from it")
    return tokenizer_cls.from_pretrained(str(model_dir), tokenizer_object=Tokenizer.from_file(str(path)), **kwargs)


def load_tokenizer_with_merges(original, _device):
    @functools.wraps(original)
    def load_tokenizer(self, tokenizer):
        if not isinstance(tokenizer, (str, os.PathLike)):     # an object: upstream's own call, unchanged
            return original(self, tokenizer)
        module = sys.modules[type(self).__module__]
        self._tokenizer = tokenizer_with_merges(module.HunyuanImage3TokenizerFast, tokenizer,
                                                model_version=self.config.model_version)
        return None

    return load_tokenizer


def vit_processor_returns_tensors(original, _device):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        self.vit_info.processor = functools.partial(self.vit_processor, return_tensors="pt")

    return __init__


def padding_mask_4d(_original, _device):
    import torch

    def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
        batch, keys = mask.shape
        expanded = mask[:, None, None, :].expand(batch, 1, tgt_len if tgt_len is not None else keys, keys).to(dtype)
        inverted = 1.0 - expanded
        return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)

    return _prepare_4d_attention_mask


def vit_kwargs_on_device(original, device):
    """upstream's _prepare_vit_image_kwargs (a staticmethod) gives the ViT's spatial shapes and padding
    masks on the host, and its to_device passes that dict on as it is: the mask then meets the device's
    attention scores in SigLIP2 (siglip2.py, `attn_weights + attention_mask`). Every tensor of it on the
    device the adaptor is applied for."""
    def _prepare_vit_image_kwargs(*args, **kwargs):
        packed = original(*args, **kwargs)
        if packed is None:
            return None
        return {name: [t.to(device.torch_device) for t in tensors] for name, tensors in packed.items()}

    functools.update_wrapper(_prepare_vit_image_kwargs, getattr(original, "__func__", original))
    return staticmethod(_prepare_vit_image_kwargs) if isinstance(original, staticmethod) else _prepare_vit_image_kwargs


def pipeline_call_honours_steps(original, _device):
    @functools.wraps(original)
    def __call__(self, *args, model_kwargs=None, **kwargs):
        if model_kwargs is not None:
            if model_kwargs.get("diff_infer_steps") is not None:
                kwargs["num_inference_steps"] = model_kwargs["diff_infer_steps"]
            if model_kwargs.get("diff_guidance_scale") is not None:
                kwargs["guidance_scale"] = model_kwargs["diff_guidance_scale"]
        return original(self, *args, model_kwargs=model_kwargs, **kwargs)

    return __call__


def eager_not_compiled(original, _device):
    """A `torch.compile`d function of upstream's, run as it was before compiling."""
    eager = getattr(original, "_torchdynamo_orig_callable", None) or getattr(original, "__wrapped__", original)

    @functools.wraps(eager)
    def run_eagerly(*args, **kwargs):
        return eager(*args, **kwargs)

    return run_eagerly
