"""A batch of requests through the two phases: each request's text phase, one handoff each, one image batch.

The job as stages (docs/SERVING.md, "Batches: requests that share a forward"):

    text_stage(model, calls, keep_going)  -> [TextHandoff | Exception]     one per request (THE SEAM)
    image_batches(model, handoffs)        -> [[index, ...], ...]           requests that share a generated size
    denoise_batch(model, handoffs, ...)   -> [PIL image, ...]              one denoising loop for them all

`text_stage` is the text phase of a batch. Each request runs the path a single image takes:
upstream's own `generate_image` (think / recaption / think_recaption, the ratio token of image size
auto, through transformers' `generate`, text/decode.py's loop and text/phase.py's shared sampler),
stopped where upstream would prepare its image call (`prepare_model_inputs(mode="gen_image")`, the
`stops_before_image` row). What upstream was about to pass there IS the handoff: the prompt, the
cot text as upstream formats it, the system prompt after its `drop_think` switch, the seed, the
image size the ratio chose (or the request's), the conditioning images. One request: exactly that.
Two or more: their text calls are decoded together (text/batch.py): the calls that may share one
(text.rows.share_key: all but the rows' prompts, system prompts, cot texts, images and seeds alike)
are made as ONE call of B right-padded rows (one prefill, decode steps of B rows, a row that stopped
emitting pad until all stopped), each row drawing from its own request's sampler, and answered back
into each request's generate_image; the others run alone. The TextHandoffs are the ones each request
returns alone (its tokens, text, ratio, image-call arguments), each request's exception in its place.

`denoise_batch` is upstream's own batch machinery: `prepare_model_inputs` with lists (prompts,
cot texts, system prompts, seeds, images; the sequences right-padded, each row's RoPE, image
slices and attention mask its own), then its pipeline with one generator per request, so row i
draws the initial noise request i draws alone. The patched forwards see B rows per CFG branch
([cond B ; uncond B]): CFG parallel keeps each branch's B rows (parallel/cfg_split.py), sequence
shares cut over all B sequences' rows (parallel/sequence.py), the step cache decides once for the
batch (adaptive: the largest change over its rows), VAE parallel decodes the B latents together.
Where upstream's batch path is wrong for B > 1, a row of model_adaptor.PATCHES mends it:

  both tokenizers' `batch_gen_infer`   a batched chat template encoded only the first sequence
        (`zip` over a one-element prompt list): every sequence is encoded.
  Instruct `_encode_cond_image` / `vae_encode`   every row's conditioning latent was drawn from
        the first request's generator (diffusers' randn_tensor takes generator[0] for a one-image
        draw): each row's images now draw from their own request's generator, in the order one
        request alone draws them (its latents, then its noise).
  Instruct `instantiate_guidance_tokens` / `instantiate_vae_image_tokens`   Distil's guidance is
        one value ([1]) the model reshapes to [batch, 1, hidden]: repeated to one value per row.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

from . import forward_context
from .model_family import takes_conditioning_images
from .text.batch import decode_together, shares_text
from .text.phase import ImagePhaseReached


@dataclass
class TextHandoff:
    """One request's text phase, handed to the image phase.

    image_call  the arguments upstream's generate_image passes to prepare_model_inputs(mode="gen_image"):
                prompt, cot_text (base: the text or None; Instruct: [think / recaption token + text] or
                None), system_prompt (after drop_think), seed, image_size (the ratio's (height, width)
                or the request's), and the Instruct model's image, infer_align_image_size
    text_phase  text.phase.TextPhase: the tokens of every call, the text, the ratio, the seconds"""
    image_call: dict
    text_phase: object

    @property
    def image_size(self):
        return self.image_call.get("image_size", "auto")


# ---------------------------------------------------------------- the text stage (the seam)

def stops_before_image(inner: Callable = None) -> Callable:
    """A PATCHES `make` for a model's prepare_model_inputs: during a text stage its gen_image call
    raises ImagePhaseReached with the call's arguments instead of preparing the image. `inner`: the
    make of another replacement of the same attribute, run otherwise (text/phase.py's seeded one)."""

    def make(original, device):
        replaced = inner(original, device) if inner is not None else original
        signature = inspect.signature(original)

        @functools.wraps(original)
        def prepare_model_inputs(self, *args, **kwargs):
            if forward_context.current().text_stage_only and kwargs.get("mode") == "gen_image":
                arguments = dict(signature.bind(self, *args, **kwargs).arguments)
                arguments.pop("self")
                arguments.update(arguments.pop("kwargs", {}))
                raise ImagePhaseReached(arguments)
            return replaced(self, *args, **kwargs)

        return prepare_model_inputs

    return make


def text_stage(model, calls: list, keep_going: Callable = lambda exc: False) -> list:
    """The text phase of every request of a batch: [TextHandoff], one per `calls` entry (the
    keyword arguments of upstream's generate_image for that request). A request whose text phase
    raises gets its exception in its place when keep_going(exc), else the exception propagates
    (a failed collective must end the job). Every rank runs it with the same calls and gets the
    same handoffs (text/phase.py: every token chosen on global rank 0). Two or more requests: their
    text calls decoded together, as rows of one call (text/batch.py); the handoffs are the same."""
    if shares_text(model, calls):
        return decode_together(model, calls, keep_going, _text_phase_of_one)
    out = []
    for kwargs in calls:
        try:
            out.append(_text_phase_of_one(model, kwargs))
        except Exception as exc:
            if not keep_going(exc):
                raise
            out.append(exc)
    return out


def _text_phase_of_one(model, kwargs: dict) -> TextHandoff:
    try:
        with forward_context.using(text_stage_only=True):
            model.generate_image(**kwargs)
    except ImagePhaseReached as reached:
        return TextHandoff(reached.arguments, reached.text_phase)
    raise RuntimeError("text stage: upstream's generate_image made an image without preparing its image call")


# ---------------------------------------------------------------- the image stage

def generated_size(model, image_size) -> tuple:
    """(height, width, ratio index) upstream generates for `image_size` ("HxW", "H:W", (H, W)):
    the bucket it snaps to. Requests whose image phases share one forward must agree on it."""
    processor = model.image_processor
    if takes_conditioning_images(model):
        info = processor.build_gen_image_info(image_size, add_guidance_token=model.config.cfg_distilled,
                                              add_timestep_r_token=model.config.use_meanflow)
    else:
        info = processor.build_image_info(image_size)
    return info.image_height, info.image_width, info.ratio_index


def image_batches(model, handoffs: list) -> list:
    """The indices of `handoffs` (None: a request that does not go on) grouped by the size their
    images are generated at, each group in request order, groups in order of first appearance."""
    groups: dict = {}
    for index, handoff in enumerate(handoffs):
        if handoff is not None:
            groups.setdefault(generated_size(model, handoff.image_size), []).append(index)
    return list(groups.values())


def denoise_batch(model, handoffs: list, image_kwargs: dict) -> list:
    """One image per handoff (one generated size), made in one denoising loop: upstream's
    prepare_model_inputs with every request's arguments as lists, then its pipeline.
    `image_kwargs`: what generate_image hands upstream's image call besides the inputs
    (diff_infer_steps, diff_guidance_scale)."""
    try:       # their prompt KV starts the first step (text/kv_reuse.py)
        with forward_context.using(image_phases=[h.text_phase for h in handoffs]):
            return _denoise(model, handoffs, image_kwargs)
    finally:
        for handoff in handoffs:
            handoff.text_phase.prompt_kv = None


def _denoise(model, handoffs: list, image_kwargs: dict) -> list:
    calls = [h.image_call for h in handoffs]
    cot_texts = [_one_text(c.get("cot_text")) for c in calls]
    inputs = dict(prompt=[c["prompt"] for c in calls], system_prompt=[c.get("system_prompt") for c in calls],
                  cot_text=cot_texts if any(t is not None for t in cot_texts) else None,
                  seed=[c["seed"] for c in calls], image_size=calls[0].get("image_size", "auto"), mode="gen_image")
    if not takes_conditioning_images(model):
        model_inputs = model.prepare_model_inputs(**inputs)
        return list(model._generate(**model_inputs, **image_kwargs, verbose=0))
    images = [_image_list(c.get("image")) for c in calls]
    align = bool(calls[0].get("infer_align_image_size", False))
    if any(images):         # upstream's check takes one request's images: each row's built as its preprocess does
        inputs["batch_cond_images"] = [model.image_processor.build_cond_images(image_list=row, infer_align_image_size=align)
                                       for row in images]
    inputs["infer_align_image_size"] = align
    model.use_taylor_cache = False                  # upstream's own Taylor cache: ours runs instead (step_cache.py)
    model_inputs = model.prepare_model_inputs(**inputs)
    outputs = model.generate(**model_inputs, **image_kwargs)
    model.image_processor.postprocess_outputs(outputs, batch_cond_images=model_inputs["batch_cond_images"],
                                              infer_align_image_size=align)
    return list(outputs)


def _one_text(cot_text):
    """The Instruct model hands its cot text on as a one-element list; the base model as a string."""
    return cot_text[0] if isinstance(cot_text, list) else cot_text


def _image_list(image) -> list:
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


# ---------------------------------------------------------------- upstream's batch path mended (PATCHES rows)

class RowGenerators(list):
    """A batch's generators (one per request) that also hands out, image by image in row order,
    the generator of the row each conditioning image belongs to."""

    def __init__(self, generators: list, images_per_row: list):
        super().__init__(generators)
        self._order = iter([generators[row] for row, count in enumerate(images_per_row) for _ in range(count)])

    def next_image(self):
        return next(self._order)


def cond_images_from_own_generators(original, _device):
    """Patch for the Instruct model's _encode_cond_image: with one generator per row, each row's
    images are VAE-encoded with their own request's generator (vae_encode below)."""

    @functools.wraps(original)
    def _encode_cond_image(self, batch_cond_images, cfg_factor=1, generator=None):
        if isinstance(generator, list) and len(generator) > 1 and batch_cond_images \
                and len(generator) == len(batch_cond_images):
            generator = RowGenerators(generator, [len(row) for row in batch_cond_images])
        return original(self, batch_cond_images, cfg_factor, generator=generator)

    return _encode_cond_image


def vae_encode_with_row_generator(original, _device):
    """Patch for the Instruct model's vae_encode: a RowGenerators list gives this image's own generator."""

    @functools.wraps(original)
    def vae_encode(self, image, cfg_factor=1, generator=None):
        if isinstance(generator, RowGenerators):
            generator = generator.next_image()
        return original(self, image, cfg_factor, generator=generator)

    return vae_encode


def guidance_per_row(original, _device):
    """Patch for the Instruct model's instantiate_guidance_tokens and instantiate_vae_image_tokens
    (the first step's guidance token and the later steps' embeddings): Distil's one guidance value
    (the pipeline's [1] tensor) repeated to one per row of a batch of more than one."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def instantiate(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        guidance, hidden = arguments.get("guidance"), arguments.get("hidden_states")
        rows = len(hidden) if hidden is not None else len(arguments["images"])
        if guidance is not None and guidance.numel() == 1 and rows > 1:
            arguments["guidance"] = guidance.reshape(1).repeat(rows)
            return original(**arguments)
        return original(self, *args, **kwargs)

    return instantiate


def every_message_list_encoded(original, _device):
    """Patch for both tokenizers' batch_gen_infer: upstream's batched apply_general_template calls it
    with `prompt_list=[[]]` and one kwargs entry per sequence, and its `zip` then encodes only the
    first sequence (a batch of B prompts became one). One empty prompt per sequence instead."""

    @functools.wraps(original)
    def batch_gen_infer(self, infer_fn, prompt_list, *args, infer_fn_kwargs_list=None, **kwargs):
        if infer_fn_kwargs_list is not None and prompt_list == [[]] and len(infer_fn_kwargs_list) > 1:
            prompt_list = [[] for _ in infer_fn_kwargs_list]
        return original(self, infer_fn, prompt_list, *args, infer_fn_kwargs_list=infer_fn_kwargs_list, **kwargs)

    return batch_gen_infer
