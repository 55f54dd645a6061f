"""KV reused instead of recomputed (adaptor_patches/text/kv_reuse.py, issue 35 part 3).

- the image phase's first step starts from the text call's prompt KV (system prompt, prompt,
  conditioning images: the rows' common prefix, conditional and unconditional alike) and computes
  only the positions after it: the image equals the one computed without reuse within the Instruct
  tests' bounds (>= 40 dB, latents <= 2e-2), on one process and on two ranks (CFG parallel, MoE EP);
- a job's next text prefill starts from the last prompt's system prompt: the same text as a fresh
  model's, with the reused positions recorded;
- a prefix never reaches past the first position whose embedding is not its token's (another
  request's images share the placeholder ids).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import model_adaptor
from adaptor_patches.text import kv_reuse
from generation import latent_rel_err, psnr
from harness.multirank import run_ranks
from instruct_runs import demo_image, generate, load

EDIT = dict(image=demo_image("input_0_0.png"), bot_task="think_recaption", image_size="auto", max_new_tokens=40)


def edit_runs(model_dir, out_dir, layout=None, rank: int = 0) -> dict:
    """{reuse on/off: Run} of one edit, the same model; reuse on also checks its record."""
    try:
        model = load(model_dir, False, layout, rank)
        encode, encoded = model._forward_vision_encoder, []

        def counted(*args, **kwargs):
            encoded[-1] += 1
            return encode(*args, **kwargs)
        model._forward_vision_encoder = counted
        runs = {}
        for reuse in (False, True):
            model.kv_reuse = reuse
            encoded.append(0)
            runs[reuse] = generate(model, out_dir / f"rank-{rank}", f"reuse-{reuse}", **EDIT)
            runs[reuse].vision_encodes = encoded[-1]
        return runs
    finally:
        model_adaptor.remove()


def _check(runs: dict, reference, rank: int = 0) -> dict:
    """`rank` other than 0: its image is never read (only rank 0 writes or answers), so it is not
    decoded (autoencoder_kl_3d.py); its latents must still be the reference's."""
    record = runs[True].text_phase["kv_reuse"]
    # the conditioning image's 256 VAE tokens and its ViT tokens are in the prefix, the generated image is not
    assert record["prefix_tokens"] >= 256 and record["first_step_positions"] == record["positions"] - record["prefix_tokens"]
    assert "kv_reuse" not in runs[False].text_phase
    assert runs[True].vision_encodes == 1 < runs[False].vision_encodes     # the text call only, not the first step
    assert runs[True].cot_text == reference.cot_text
    if rank == 0:
        assert psnr(runs[True].png, reference.png) >= 40
    assert latent_rel_err(runs[True].latents, reference.latents) <= 2e-2
    return record


@pytest.fixture(scope="module")
def one_process(tiny_instruct, tmp_path_factory) -> dict:
    """edit_runs on one process, once for the tests below (the two-rank ones compare with its image)."""
    return edit_runs(tiny_instruct, tmp_path_factory.mktemp("one_process"))


@pytest.mark.slow
@pytest.mark.usefixtures("unpatched_upstream")
def test_the_first_step_starts_from_the_text_prompt_and_draws_the_same_image(one_process):
    _check(one_process, one_process[False])


def reuse_on_rank(rank, world_size, model_dir, flags, out_dir):
    from adaptor_patches.parallel.layout import Layout
    return edit_runs(model_dir, out_dir, Layout.from_flags(world_size, **flags), rank)


@pytest.mark.slow
@pytest.mark.usefixtures("unpatched_upstream")
@pytest.mark.parametrize("flags", [dict(cfg_parallel=True), dict(moe_ep=True)], ids=["cfg2", "moe-ep2"])
def test_two_ranks_start_from_the_text_prompt(tiny_instruct, one_process, tmp_path, flags):
    """Under CFG parallel the conditional ranks also start past the think text (their rows continue
    it; the unconditional rows part from it at the user's words)."""
    alone = one_process[False]
    for rank, runs in enumerate(run_ranks(2, reuse_on_rank, tiny_instruct, flags, tmp_path / "ranks")):
        record = _check(runs, alone, rank)
        assert record["cond_prefix_tokens"] > record["prefix_tokens"], record


def texts_in_a_row(model_dir, reuse: bool) -> list:
    """Three requests on one model (the job's system prompt each time; the second with an image):
    each one's text tokens and its prefill's reused positions."""
    from adaptor_patches import forward_context
    from adaptor_patches.forward_context import JobCache
    from adaptor_patches.image_batch import text_stage
    try:
        model = load(model_dir, False)
        model.kv_reuse = reuse
        out, cache = [], JobCache()                  # one job: its requests share the last prompt's KV
        for prompt, image in (("a red fox", None), ("a blue bird on a branch", demo_image("input_0_0.png")),
                              ("a lighthouse at dusk", None)):
            with forward_context.request(cache):
                handoff = text_stage(model, [dict(prompt=prompt, image=[image] if image else None, seed=5,
                                                  bot_task="think", image_size="256x256", max_new_tokens=24,
                                                  use_system_prompt="en_unified")])[0]
            call = handoff.text_phase.calls[0]
            out.append((call.new_token_ids, call.decode["prefill_positions_reused"]))
        return out
    finally:
        model_adaptor.remove()


@pytest.mark.slow
@pytest.mark.usefixtures("unpatched_upstream")
def test_a_job_prefills_its_system_prompt_once(tiny_instruct):
    fresh = texts_in_a_row(tiny_instruct, reuse=False)
    reused = texts_in_a_row(tiny_instruct, reuse=True)
    assert [tokens for tokens, _ in reused] == [tokens for tokens, _ in fresh]
    assert [n for _, n in fresh] == [0, 0, 0]
    first, second, third = (n for _, n in reused)
    assert first == 0 and second >= 1000 and third >= 1000       # en_unified: ~2.8k positions before "User:"


def test_a_prefix_stops_before_the_first_position_an_image_fills():
    output = SimpleNamespace(tokens=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]]),
                             vae_image_mask=torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]]),
                             cond_timestep_scatter_index=torch.tensor([[6], [3]]))
    assert kv_reuse.tokens_only_length(output, 8) == [5, 3]
    assert kv_reuse.common_prefix(output.tokens, torch.tensor([[1, 2, 3, 9], [1, 2, 3, 4]])) == 3


def batch_images(model_dir, out_dir, reuse: bool) -> list:
    """Two edits (different prompts, seeds and images) decoded and denoised as one batch: [(PNG, record)]."""
    from adaptor_patches.image_batch import denoise_batch, text_stage
    try:
        model = load(model_dir, False)
        model.kv_reuse = reuse
        calls = [dict(EDIT, prompt="a red fox standing in fresh snow", seed=7, image=[demo_image("input_0_0.png")],
                      use_system_prompt="None", image_size="256x256"),
                 dict(EDIT, prompt="put a hat on it", seed=11, image=[demo_image("input_1_0.png")],
                      use_system_prompt="None", image_size="256x256")]
        handoffs = text_stage(model, calls)
        images = denoise_batch(model, handoffs, dict(diff_infer_steps=2))
        out = []
        for i, (image, handoff) in enumerate(zip(images, handoffs)):
            path = out_dir / f"reuse-{reuse}-{i}.png"
            out_dir.mkdir(parents=True, exist_ok=True)
            image.save(path)
            out.append((path, handoff.text_phase.kv_reuse, handoff.text_phase.prompt_kv_row))
        return out
    finally:
        model_adaptor.remove()


@pytest.mark.slow
@pytest.mark.usefixtures("unpatched_upstream")
def test_a_batch_starts_each_row_from_its_own_request(tiny_instruct, tmp_path):
    """The text calls of a batch run as rows of one call (text/batch.py): each request's first step
    starts from its own row of that call's KV."""
    fresh = batch_images(tiny_instruct, tmp_path, reuse=False)
    reused = batch_images(tiny_instruct, tmp_path, reuse=True)
    assert [row for _, _, row in reused] == [0, 1]
    for (path, record, _), (reference, none, _) in zip(reused, fresh):
        assert none is None and record["prefix_tokens"] >= 256, record
        assert psnr(path, reference) >= 40
