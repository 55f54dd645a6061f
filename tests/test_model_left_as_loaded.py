"""A request leaves the model as loaded (issue 49): its state lives in the call's forward context
(adaptor_patches/forward_context.py), what outlives it in the job's JobCache, never on the model.

Every module's attributes, and the plain objects they hold one level down, are recorded after
loading (tests/model_state.py) and again after requests on each path that runs them in-process:
`--prompt` (run_image_gen.generate), a batch of the text and image stages (`--prompts`, and with a
denoise watch and previews `--serve`: utils/runtime/engine/batch_stages.py), on the base model and on
Instruct, with the ratio call (base, size auto) and think_recaption (its prompt KV reused by the image's first step and the system prompt
by the next request), a step cache and a batch of two. Nothing may be added or changed but what
upstream's own code writes on every call (UPSTREAMS_OWN) and a kernel set's scratch workspace
(model_state.WORKSPACE).
"""
import re

import pytest

from adaptor_patches.denoise_watch import DenoiseWatch, preview_plan
from adaptor_patches.forward_context import JobCache
from adaptor_patches.step_cache import StepCacheSettings
from model_state import differences, record

# upstream's writes on every call, not ours (modeling_hunyuan_image_3.py): generate_image sets
# use_taylor_cache and the taylor_cache_* settings (its Taylor-cache arguments), post_token_len from the
# tokens, num_image_tokens / num_special_tokens from the image info; its pipeline and scheduler keep the
# last call's guidance, timesteps and step index (hunyuan_image_3_pipeline.py); its CachedRoPE keeps the
# tables of the last image layout its forward asked for (modeling_hunyuan_image_3.py, self.cached_rope).
UPSTREAMS_OWN = re.compile(r"(added|changed) (num_image_tokens|num_special_tokens|post_token_len|use_taylor_cache|"
                           r"taylor_cache_\w+|_pipeline|scheduler|cached_rope)\Z")


def requests_for(model_dir, *extra):
    import run_image_gen
    from utils.runtime.requests.job_args import default_request
    args = run_image_gen.parse_args(["--model-id", str(model_dir), "--device", "cpu", "--seed", "5",
                                     "--diff-infer-steps", "3", "--max-new-tokens", "6", *extra])
    return args, default_request(args)


def run_paths(model, model_dir, size, bot_task):
    from dataclasses import replace
    import run_image_gen
    from utils.runtime.engine.batch_stages import BatchStages
    args, request = requests_for(model_dir, "--image-size", size, "--bot-task", bot_task)
    cache = JobCache()
    for step_cache in (None, StepCacheSettings("taylor", warmup=1, interval=2, order=1)):   # --prompt, twice
        made = run_image_gen.generate(model, args, replace(request, step_cache=step_cache), 0, cache=cache)
        assert made.image is not None and made.text_phase is not None
    batch = [replace(request, seed=1, prompt="a red fox"), replace(request, seed=2, prompt="a blue bird",
                                                                   partial_images=1)]
    for watch_for in (None, lambda indices, members: DenoiseWatch(3, previews=preview_plan(members))):
        stages = BatchStages(model, args, 0, watch_for)          # --prompts; with a watch and previews: --serve
        handoffs = stages.text(batch, lambda exc: False)
        made = stages.image(batch, handoffs)
        assert all(isinstance(m, tuple) for m in made), made


@pytest.mark.parametrize("which", ["base", "instruct"])
def test_requests_on_every_path_leave_the_model_as_loaded(which, tiny_model, tiny_instruct):
    import model_adaptor
    from utils.runtime.engine.rank_model import load_rank_model
    model_dir, size, task = (tiny_model, "auto", "image") if which == "base" else \
        (tiny_instruct, "256x256", "think_recaption")      # base: its text phase is the ratio call (size auto)
    try:
        model, _ = load_rank_model(model_dir)
        before = record(model)
        run_paths(model, model_dir, size, task)
        found = [d for d in differences(before, record(model)) if not UPSTREAMS_OWN.match(d)]
        assert not found, found
    finally:
        model_adaptor.remove()
