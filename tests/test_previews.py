"""Previews of a served image (partial_images): when they are taken, and that each is the clean latent
the scheduler's step predicts, with the loop's own latents unchanged. Upstream's scheduler, no model."""
import torch

from adaptor_patches.denoise_watch import DenoiseWatch, preview_plan, preview_steps, watching
from adaptor_patches.previews import scheduler_step_with_previews
from utils.runtime.requests.image_requests import ImageRequest


def test_preview_steps_are_evenly_spaced_and_never_the_last():
    assert preview_steps(4, 2) == [1, 3] and preview_steps(50, 3) == [12, 25, 38] and preview_steps(8, 1) == [4]
    assert preview_steps(2, 2) == [1] and preview_steps(1, 3) == [] and preview_steps(30, 0) == []
    rows = [ImageRequest(prompt="a", diff_infer_steps=4, partial_images=2),
            ImageRequest(prompt="b", diff_infer_steps=4, partial_images=0),
            ImageRequest(prompt="c", diff_infer_steps=4, partial_images=1)]
    assert preview_plan(rows) == {1: [0], 2: [2], 3: [0]}


def test_a_preview_is_the_clean_latent_the_step_predicts_and_changes_nothing():
    from hunyuan_image_3.hunyuan_image_3_pipeline import FlowMatchDiscreteScheduler
    steps, rows = 4, 3
    plain = FlowMatchDiscreteScheduler(shift=3.0, reverse=True, solver="euler")
    watched = FlowMatchDiscreteScheduler(shift=3.0, reverse=True, solver="euler")
    step = scheduler_step_with_previews(FlowMatchDiscreteScheduler.step, None)
    for scheduler in (plain, watched):
        scheduler.set_timesteps(steps)
    decoded = []
    watch = DenoiseWatch(steps, previews={1: [0, 2], 2: [1], 3: [0, 1, 2], 4: [1]},
                         decode=lambda latents: [latents.clone()], on_preview=lambda row, image: None)
    watch.decode = lambda latents: (decoded.append((watch.step, latents.clone())) or [None] * len(latents))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(rows, 4, 8, 8, generator=generator)
    ours, theirs = latents.clone(), latents.clone()
    with watching(watch):
        for i, t in enumerate(plain.timesteps):
            velocity = torch.randn(rows, 4, 8, 8, generator=generator)
            watch.step = i
            sigma = plain.sigmas[i]
            theirs = plain.step(velocity, t, theirs, return_dict=False)[0]
            before = ours
            ours = step(watched, velocity, t, ours, return_dict=False)[0]
            assert torch.equal(ours, theirs)                 # the loop's latents are untouched
            wanted = watch.previews.get(i + 1, []) if i + 1 < steps else watch.previews.get(i + 1, [])
            if wanted:
                at, clean = decoded[-1]
                assert at == i and torch.allclose(clean, (before - sigma * velocity)[wanted], atol=1e-6)
            if i == steps - 1:                                # the last step lands on its own prediction (sigma 0)
                assert watched.sigmas[-1] == 0 and torch.allclose(clean, ours[wanted], atol=1e-5)
    assert [at for at, _ in decoded] == [0, 1, 2, 3]
