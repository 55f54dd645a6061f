"""The Python API: load the model once, make images from Python, on one process or every rank of a job.

    from utils.pipeline import Pipeline
    pipe = Pipeline.load("models/tiny", device="cpu", image_size="64x64", diff_infer_steps=4)
    for result in pipe.generate(["a red fox in the snow", {"prompt": "a lighthouse", "seed": 7}]):
        result.image.save(f"{result.request.seed}.png")

`Pipeline.load(model_id, **options)` takes run_image_gen.py's flags as keywords (`moe_ep=True`,
`cfg_parallel=True`, `quantize="int4"`, `step_cache="taylor"`, ...; a flag's value as its own type)
and checks them as the CLI does (one FieldError naming the flag). Under torchrun every rank runs the
same script: the ranks form the layout's groups, every rank loads its slice, and `generate` makes
rank 0's requests on every rank (they are broadcast), so the other ranks may pass anything.

`generate(requests, progress=None)` takes prompts or dicts of a prompts-file line's fields (prompt,
seed, image_size, diff_infer_steps, bot_task, step_cache, guidance_scale, and on an Instruct
checkpoint image: 1 to 3 paths), each checked before anything runs, and returns one ImageResult per
request in order (utils/runtime/engine/rank_loop.py: image, text, the text phase's and step cache's records,
seconds, the forward batch it shared; `error` instead of an image when it failed on every rank).
Requests that may share a forward are made together (`batch_size`, default 1). Rank 0's results hold
the images. `progress(images done, images, step, steps)` is called on rank 0 at every denoising step.

It is the same path as `--prompts` and `--serve` (utils/runtime/engine/rank_loop.py -> batch_stages.py):
the text stage, the handoff, the denoising batch, the VAE decode, in the forward context of each
batch (adaptor_patches/forward_context.py) with one JobCache for the pipeline's life.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable, Optional


def flags_of(parser, options: dict) -> list:
    """run_image_gen.py's argv for keyword options: a switch True -> --flag (False left out), None left
    out, else --flag value; FieldError for an option run_image_gen.py has not or a switch not a bool."""
    from utils.runtime.requests.errors import FieldError
    argv = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        action = parser._option_string_actions.get(flag)        # argparse keeps no public map of its flags
        if action is None:
            raise FieldError(name, "not an option of run_image_gen.py", "see run_image_gen.py --help (moe_ep for "
                                                                     "--moe-ep)")
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise FieldError(flag[2:], f"{value!r} is not True or False", f"pass {name}=True")
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return argv


class Pipeline:
    def __init__(self, rank_job, model, loop, key, load_s: float):
        self.rank_job, self.model, self.loop, self.key, self.load_s = rank_job, model, loop, key, load_s
        self.args, self.rank = rank_job.args, rank_job.rank
        self.progress: Optional[Callable] = None
        self._done, self._total = 0, 0
        from utils.runtime.requests.image_requests import RequestChecker, adapter_names
        self.checker = RequestChecker(self.args.model_id, adapters=adapter_names(self.args.lora_modules))     # its tokenizer read once, on the first request

    @classmethod
    def load(cls, model_id, **options) -> "Pipeline":
        """Check the options, set up the device and the process group (torchrun's RANK / WORLD_SIZE, else
        one process), load this rank's weights."""
        import torch
        import run_image_gen
        from utils.runtime.engine.batch_stages import BatchStages
        from utils.runtime.requests.batching import key_for
        from utils.runtime.requests.job_args import build_parser
        from utils.runtime.requests.job_check import check_job
        from utils.runtime.engine.rank_loop import RankLoop
        parser = build_parser()
        parser.raises = True                            # a FieldError naming the flag, not an exit
        args = parser.parse_args(["--model-id", str(model_id), *flags_of(parser, options)])
        rank = int(os.environ.get("RANK", "0"))
        job = check_job(args, world_size=int(os.environ.get("WORLD_SIZE", 1)), env=os.environ,
                        writes_outputs=False, api=True)
        phase = run_image_gen.JobPhase()
        rank_job = run_image_gen.prepare(job, rank, phase)
        with torch.no_grad():
            model, load_s = run_image_gen.load(rank_job, phase)
        model.pipeline.set_progress_bar_config(disable=True)
        pipe = cls(rank_job, model, None, key_for(model), load_s)
        stages = BatchStages(model, args, rank, pipe._watch)
        pipe.loop = RankLoop(rank_job.dist, rank, stages, run_image_gen.is_collective_failure)
        return pipe

    def request(self, entry, number: int = 1):
        """One checked ImageRequest from a prompt or a dict of a prompts-file line's fields."""
        from utils.runtime.requests.image_requests import LINE_FIELDS
        from utils.runtime.requests.job_args import default_request
        from utils.runtime.requests.request_schema import REQUEST, FieldError
        entry = {"prompt": entry} if isinstance(entry, str) else dict(entry)
        defaults = default_request(self.args)
        try:
            unknown = sorted(set(entry) - set(LINE_FIELDS) - {"save"})
            if unknown or "save" in entry:
                name = unknown[0] if unknown else "save"
                raise FieldError(name, f"unknown field '{name}'", f"fields are {', '.join(LINE_FIELDS[:-1])}")
            if "prompt" not in entry:
                raise FieldError("prompt", "missing", "every request needs a prompt")
            fields = {name: REQUEST[name].check(value, base=getattr(defaults, name)) for name, value in entry.items()}
            request = replace(defaults, **fields, save=None, save_text=None, label=f"request {number}")
            problem = self.checker.problem(request)
            if problem:
                raise problem
        except FieldError as exc:
            raise exc.renamed(f"request {number}: {exc.field}") from None
        return request

    def generate(self, requests, progress: Optional[Callable] = None) -> list:
        """One ImageResult per request (module docstring); every rank makes rank 0's requests."""
        import torch
        from utils.runtime.requests.image_requests import choose_seed
        from utils.runtime.requests.batching import take_batch
        from utils.runtime.requests.input_images import with_images
        checked = [with_images(choose_seed(self.request(r, i))) for i, r in enumerate(requests, 1)] \
            if self.rank == 0 else None
        checked = self.loop.broadcast(checked)
        self.progress, self._done, self._total = progress, 0, len(checked)
        results, pending = {}, list(enumerate(checked))
        with torch.no_grad():
            while pending:
                batch, pending = take_batch(pending, max(1, self.args.batch_size), lambda item: self.key(item[1]))
                for (index, _), result in zip(batch, self.loop.run_batch([r for _, r in batch])):
                    results[index] = result
                self._done += len(batch)
        return [results[i] for i in range(len(checked))]

    def _watch(self, indices, members):
        """Each forward batch's DenoiseWatch: rank 0's progress callback, no cancel (nothing asks for one)."""
        from adaptor_patches.denoise_watch import DenoiseWatch
        if self.progress is None or self.rank != 0:
            return None
        done, total = self._done, self._total
        return DenoiseWatch(members[0].diff_infer_steps, agree=False,
                            on_step=lambda step, steps: self.progress(done, total, step, steps))

    def close(self) -> None:
        """Leave the process group this pipeline made (every rank together)."""
        from run_image_gen import end_job
        end_job(self.rank_job.dist, self.rank_job.owns_group)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
