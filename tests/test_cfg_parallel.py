"""CFG parallel (parallel/cfg_split.py, hunyuan.causal_mm_forward): which rows each rank runs, the gather.

The end-to-end equality with a single-process image is in test_layouts.py; here: on two real gloo
ranks with the tiny checkpoint, every gen_image forward below the patch sees exactly its half of
the batch (rank 0 the cond rows, rank 1 the uncond rows), the static KV cache holds only that half,
and both ranks end with bit-identical latents (the guidance step runs on the gathered prediction).
"""
import functools
import json
import shutil

import pytest
import torch

import model_adaptor
from adaptor_patches import hunyuan
from adaptor_patches.kernels.device import Device
from adaptor_patches.parallel import cfg_split
from adaptor_patches.parallel.context import RankContext
from adaptor_patches.parallel.layout import Layout
from generation import PROMPT, run_cli_in_process
from harness.multirank import run_ranks

pytestmark = pytest.mark.usefixtures("unpatched_upstream")


# ---------------------------------------------------------------- the split, without ranks

def batch_inputs(rows=4, seq=6):
    ramp = torch.arange(rows)
    return dict(input_ids=ramp[:, None].expand(rows, seq), attention_mask=ramp.view(rows, 1, 1, 1).expand(rows, 1, seq, seq),
                position_ids=ramp[:, None] * 10, images=ramp.view(rows, 1, 1, 1).float(), image_mask=ramp[:, None],
                timestep=ramp.float(), gen_timestep_scatter_index=ramp[:, None],
                custom_pos_emb=(ramp.view(rows, 1, 1).float(), -ramp.view(rows, 1, 1).float()),
                cond_vae_images=list(range(rows)), vit_kwargs={"spatial_shapes": list(range(rows))},
                mode="gen_image", first_step=True, past_key_values="the cache", cond_timestep=None)


@pytest.mark.parametrize("part", [0, 1])
def test_split_takes_this_branch_rows_of_every_batch_major_input(part):
    local = cfg_split.split_arguments(batch_inputs(), 4, part)
    rows = [2 * part, 2 * part + 1]
    for name in ("input_ids", "attention_mask", "position_ids", "images", "image_mask", "timestep",
                 "gen_timestep_scatter_index"):
        assert local[name].reshape(2, -1)[:, 0].tolist() == [r * (10 if name == "position_ids" else 1) for r in rows], name
    assert [t.flatten().tolist() for t in local["custom_pos_emb"]] == [rows, [-r for r in rows]]
    assert local["cond_vae_images"] == rows and local["vit_kwargs"] == {"spatial_shapes": rows}
    assert (local["mode"], local["first_step"], local["past_key_values"], local["cond_timestep"]) == \
        ("gen_image", True, "the cache", None)


def fake_forward(calls):
    def original(self, input_ids=None, mode="gen_text", return_dict=None, **kwargs):
        calls.append(input_ids)
        pred = input_ids[:, :1].float()
        return (None, "cache", pred) if return_dict is False else {"diffusion_prediction": pred, "logits": None}
    return original


class _CfgIndexOne(RankContext):
    """Rank 1 of a cfg-2 layout (the uncond branch), without a process group."""

    def group(self, dim):
        return f"{dim} group"


class _Model:
    """Stands for the base model's class: cfg_split picks the batch-major arguments by model file."""
    __module__ = "hunyuan_image_3.hunyuan"
    rank_context = _CfgIndexOne(Layout(2, cfg=2), rank=1, device=Device("cpu"))


@pytest.fixture
def one_branch(monkeypatch):
    """The patched forward as cfg index 1 sees it, with a stand-in gather: [rows of index 0 ; ours]."""
    monkeypatch.setattr(cfg_split, "gather_branches", lambda local, group, kernels: torch.cat([local - 2, local]))
    calls = []
    return functools.partial(hunyuan.causal_mm_forward(fake_forward(calls), None), _Model()), calls


@pytest.mark.parametrize("return_dict", [True, False])
def test_gen_image_runs_half_and_returns_the_full_prediction(one_branch, return_dict):
    forward, calls = one_branch
    ids = torch.arange(4)[:, None].expand(4, 3)
    out = forward(input_ids=ids, mode="gen_image", return_dict=return_dict)
    pred = out[-1] if not return_dict else out["diffusion_prediction"]
    assert calls[0][:, 0].tolist() == [2, 3]
    assert pred.flatten().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("mode,rows", [("gen_text", 4), ("gen_image", 3)])
def test_text_mode_and_odd_batches_run_unsplit(one_branch, mode, rows):
    forward, calls = one_branch
    ids = torch.arange(rows)[:, None]
    out = forward(input_ids=ids, mode=mode)
    assert calls[0] is ids and out["diffusion_prediction"].shape[0] == rows


# ---------------------------------------------------------------- two real ranks, tiny checkpoint

def generate_one_branch(rank, world_size, model_dir):
    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply("cpu")
    seen = {"full": [], "local": [], "cache_rows": None}
    try:
        model = load_model(model_dir, RankContext(Layout(world_size, cfg=2), rank, device))
        timer = PhaseTimer(device).attach(model)

        def outer(_module, _args, kwargs):
            if kwargs.get("mode") == "gen_image":
                seen["full"].append(kwargs["input_ids"].tolist())

        def inner(_module, _args, kwargs, _output):
            if kwargs.get("mode") == "gen_image":
                seen["local"].append(kwargs["input_ids"].tolist())
                seen["cache_rows"] = kwargs["past_key_values"].layers[0].keys.shape[0]

        model.register_forward_pre_hook(outer, with_kwargs=True)
        model.model.register_forward_hook(inner, with_kwargs=True)
        with torch.no_grad():
            model.generate_image(prompt=PROMPT, seed=7, image_size="64x64", diff_infer_steps=2)
        return seen, timer.last_latents.numpy()     # plain data: torch tensors would travel by shared fds
    finally:
        model_adaptor.remove()


@pytest.mark.slow
def test_each_rank_runs_its_branch_and_both_end_with_the_same_latents(tiny_model):
    (seen0, latents0), (seen1, latents1) = run_ranks(2, generate_one_branch, tiny_model)
    for part, seen in enumerate((seen0, seen1)):
        assert len(seen["local"]) == 2, "two denoising steps"
        for full, local in zip(seen["full"], seen["local"]):
            assert len(full) == 2 and local == full[part:part + 1]
        assert seen["cache_rows"] == 1, "the KV cache holds this branch's row only"
    assert seen0["local"][0] != seen1["local"][0], "cond and uncond prompts differ"
    assert (latents0 == latents1).all()


# ---------------------------------------------------------------- refusal before any weight is read

def test_guidance_at_most_one_is_refused_before_any_weight_is_read(tiny_model, tmp_path):
    model = tmp_path / "no_weights"
    model.mkdir()
    shutil.copy(tiny_model / "config.json", model)
    generation = json.loads((tiny_model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "diff_guidance_scale": 1.0}))
    proc = run_cli_in_process(["--prompt", "x", "--model-id", model, "--device", "cpu", "--cfg-parallel"],
                              env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: cfg-parallel: guidance scale 1.0"), proc.stderr
