"""The text phase (think / recaption / the ratio token of `--image-size auto`): one text per job.

- the shared sampler: every rank takes global rank 0's token, whatever its own logits and RNG;
  rank 0 draws from the warped distribution with a generator seeded by the job's seed;
- on a real TP2 job with a different global RNG state on each rank: one text, one ratio, one
  image, the sampler after transformers' warpers, and a KV cache holding only the local KV heads;
- bad input for the text modes: one `error:` line before any weight is read.
End-to-end equality with the single-process run on every layout: test_layouts.py.
"""
import hashlib
import random

import numpy as np
import pytest

from adaptor_patches import forward_context
import torch

import model_adaptor
from adaptor_patches.parallel.context import RankContext
from adaptor_patches.parallel.layout import Layout
from adaptor_patches.text.phase import SharedTokenSampler, TextPhase
from generation import PROMPT, run_cli_in_process
from harness.multirank import run_ranks

VOCAB = 50
STEPS = 12


def _scores(seed):
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def sample_on_ranks(rank, world_size, job_seed):
    """Every rank: its own logits (seeded by rank) and its own global RNG; returns the chosen tokens."""
    torch.manual_seed(1234 + rank)
    sampler = SharedTokenSampler(job_seed, do_sample=True)
    chosen = []
    for step in range(STEPS):
        out = sampler(torch.zeros(1, 3, dtype=torch.int64), _scores(100 * rank + step))
        assert torch.isfinite(out).sum().item() == 1 and out.max().item() == 0.0
        chosen.append(int(out.argmax()))
    return chosen


@pytest.mark.slow
def test_every_rank_takes_rank_zero_token_whatever_its_own_logits():
    ranks = run_ranks(2, sample_on_ranks, 77)
    alone = SharedTokenSampler(77, do_sample=True)
    rank0_choice = [int(alone.choose(_scores(step))[0]) for step in range(STEPS)]
    assert ranks[0] == ranks[1] == rank0_choice
    # rank 1's own logits would have led elsewhere: the broadcast, not luck, made them agree
    own = SharedTokenSampler(77, do_sample=True)
    assert [int(own.choose(_scores(100 + step))[0]) for step in range(STEPS)] != rank0_choice


def test_sampler_draws_from_the_distribution_and_argmax_without_sampling():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    sampler = SharedTokenSampler(3, do_sample=True)
    draws = torch.cat([sampler.choose(probs.log()) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert (freq - probs[0]).abs().max() < 0.03, freq
    assert SharedTokenSampler(3, do_sample=False).choose(probs.log()).tolist() == [0]
    again = SharedTokenSampler(3, do_sample=True)
    assert torch.equal(torch.cat([again.choose(probs.log()) for _ in range(4000)]), draws)


def test_each_call_of_a_job_gets_its_own_stream_and_a_job_seed_repeats_them():
    first, second = TextPhase(seed=9), TextPhase(seed=9)
    a1, a2, b1 = first.sampler(True), first.sampler(True), second.sampler(True)
    scores = torch.zeros(1, 1000)
    draw = lambda s: [int(s.choose(scores)[0]) for _ in range(8)]
    x1, x2, y1 = draw(a1), draw(a2), draw(b1)
    assert x1 == y1 and x1 != x2


# ---------------------------------------------------------------- a real TP2 job

def generate_on_ranks(rank, world_size, model_dir):
    """TP2, each rank with another global RNG state: returns (text, ratio, final latents' hash, kv heads, sampler
    last)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply("cpu")
    try:
        model = load_model(model_dir, RankContext(Layout(world_size), rank, device))
        timer = PhaseTimer(device).attach(model)        # the final latents (only rank 0 decodes the image)
        processors = model._get_logits_processor(generation_config=model.generation_config, input_ids_seq_length=4,
                                                 encoder_input_ids=torch.zeros(1, 4, dtype=torch.int64),
                                                 logits_processor=None, device="cpu", model_kwargs={})
        order_ok = isinstance(processors[-1], SharedTokenSampler) and any(
            isinstance(p, TopKLogitsWarper) for p in processors[:-1])
        torch.manual_seed(31 * rank + 5)
        random.seed(rank)
        np.random.seed(rank)
        with torch.no_grad(), forward_context.request() as call:
            model.generate_image(prompt=PROMPT, seed=1, image_size="auto", bot_task="think",
                                 max_new_tokens=6, diff_infer_steps=1)
        kv_heads = sorted({keys.shape[1] for step in call.cache.decode_steps.values() for keys in step.kv.keys.values()})
        phase = call.last_text_phase.summary()
        latents = hashlib.sha256(timer.last_latents.numpy().tobytes()).hexdigest()
        return phase["text"], phase["ratio"], latents, kv_heads, order_ok
    finally:
        model_adaptor.remove()


@pytest.mark.slow
def test_tp2_ranks_with_different_rng_states_write_one_text_and_keep_local_kv_heads(text_model):
    results = run_ranks(2, generate_on_ranks, str(text_model))
    (text, ratio, image, kv_heads, order_ok), other = results
    assert other == results[0]
    assert text and ratio["valid"], (text, ratio)       # a real ratio token, not the 1:1 fallback
    assert kv_heads == [1], "2 KV heads over TP2: each rank's cache holds one"
    assert order_ok, "the shared sampler must come after transformers' warpers"


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("args,message", [
    (["--bot-task", "think"], "error: bot-task: 'think' needs a checkpoint with the instruct chat template"),
    (["--bot-task", "recaption"], "error: bot-task: 'recaption' needs a checkpoint with the instruct chat template"),
    (["--save-text", "t.txt"], "error: save-text: bot-task 'image' writes no text"),
    (["--max-new-tokens", "0"], "error: max-new-tokens: 0 is not an integer >= 1"),
])
def test_text_mode_misuse_is_one_error_line_before_loading(tiny_model, tmp_path, args, message):
    save = tmp_path / "never.png"
    proc = run_cli_in_process(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--save", save, *args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr[-2000:]
    assert not save.exists()


@pytest.mark.slow
def test_prompt_beyond_the_context_is_refused_with_the_limit(text_model, tmp_path):
    import json
    import shutil
    short = tmp_path / "short_context"
    shutil.copytree(text_model, short)
    config = json.loads((short / "generation_config.json").read_text())
    # The prompt alone fits (the up-front check passes: test_reliability.py); with the think system
    # prompt and the template (~160 tokens) it does not, which the text phase finds.
    (short / "generation_config.json").write_text(json.dumps({**config, "max_length": 100}))
    proc = run_cli_in_process(["--prompt", "a fox", "--model-id", short, "--device", "cpu", "--bot-task", "think",
                    "--image-size", "64x64", "--save", tmp_path / "never.png"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: prompt: ") and "100-token context" in last, last
    assert not (tmp_path / "never.png").exists()


@pytest.mark.parametrize("model_args,field", [
    ({"bot-task": "think"}, "model_args.bot-task: 'think' needs a checkpoint with the instruct chat template"),
    ({"save-text": "out.txt"}, "model_args.save-text: bot-task 'image' writes no text"),
])
def test_launcher_refuses_text_mode_misuse_before_launch(tiny_model, tmp_path, model_args, field):
    from test_launcher import assert_one_error, run_launcher, write_yaml
    job = {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "x", "model-id": str(tiny_model), "device": "cpu", **model_args}}
    assert_one_error(run_launcher(write_yaml(tmp_path, job), "--dry-run"), field)


def test_launcher_accepts_think_on_an_instruct_checkpoint(text_model, tmp_path):
    from test_launcher import run_launcher, write_yaml
    job = {"world_size": 2, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "x", "model-id": str(text_model), "device": "cpu", "bot-task": "think",
                          "max-new-tokens": 64, "save-text": "out.txt", "image-size": "auto"}}
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "--bot-task think" in res.stdout and "--save-text out.txt" in res.stdout, res.stdout
