"""Phase timings and peak memory of one generation, read from hooks on a model instance.

This instruments an instance (forward hooks, and a wrapper on that instance's `vae.decode` and its
generation call: the base model's `_generate`, the Instruct model's `generate`); it rebinds nothing on upstream classes, so it is not in model_adaptor's table.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager

from .kernels.device import Device
from .model_family import takes_conditioning_images


class PhaseTimer:
    def __init__(self, device: Device):
        self.device = device
        self.reset()

    def reset(self):
        self.text_forward_s = []
        self.denoise_step_s = []
        self.transformer_steps = []         # the denoising steps whose forward ran the transformer (not forecast)
        self.vae_decode_s = []
        self.generate_s = {"gen_text": 0.0, "gen_image": 0.0}
        self._forward_start = None
        self._forward_mode = None
        self.last_latents = None

    def _now(self):
        self.device.synchronize()
        return time.perf_counter()

    @contextmanager
    def _timed(self, sink: list):
        start = self._now()
        try:
            yield
        finally:
            sink.append(self._now() - start)

    def attach(self, model):
        def pre_hook(_module, _args, kwargs):
            self._forward_mode = kwargs.get("mode", "gen_text")
            self._forward_start = self._now()

        def post_hook(_module, _args, kwargs, _output):
            elapsed = self._now() - self._forward_start
            (self.denoise_step_s if self._forward_mode == "gen_image" else self.text_forward_s).append(elapsed)

        def transformer_hook(_module, _args, kwargs):
            if kwargs.get("mode") == "gen_image":       # a step cache's forecast (ours or upstream's) skips it
                self.transformer_steps.append(len(self.denoise_step_s))

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        model.register_forward_hook(post_hook, with_kwargs=True)
        model.model.register_forward_pre_hook(transformer_hook, with_kwargs=True)
        self._wrap(model.vae, "decode", self._on_decode)
        call = "generate" if takes_conditioning_images(model) else "_generate"
        generate = getattr(model, call)

        @functools.wraps(generate)
        def timed_generate(*args, **kwargs):
            mode = kwargs.get("mode", "gen_text")
            start = self._now()
            try:
                return generate(*args, **kwargs)
            finally:
                self.generate_s[mode] += self._now() - start

        setattr(model, call, timed_generate)
        return self

    def _on_decode(self, z, *_args, **_kwargs):
        self.last_latents = z.detach().float().cpu()
        return self.vae_decode_s

    def _wrap(self, obj, name, sink_for):
        original = getattr(obj, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with self._timed(sink_for(*args, **kwargs)):
                return original(*args, **kwargs)

        setattr(obj, name, timed)

    def summary(self) -> dict:
        return {
            "text_ar_s": round(self.generate_s["gen_text"], 6),
            "text_ar_forwards": len(self.text_forward_s),
            "image_phase_s": round(self.generate_s["gen_image"], 6),
            "denoise_step_s": [round(t, 6) for t in self.denoise_step_s],
            "vae_decode_s": round(sum(self.vae_decode_s), 6),
        }
