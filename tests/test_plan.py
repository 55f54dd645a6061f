"""utils/planner/plan.py, utils/planner/memory_plan.py and run.sh's fit check: the plan's parameter bytes are exactly
what loading materialises (every layout of the matrix, real gloo ranks), and a layout that does not
fit is refused before launch with one line."""
import json

import pytest
import torch

from harness.multirank import run_ranks

LAYOUTS = {"single": (1, 1, "replicated", False), "tp2": (2, 1, "replicated", False), "cfg2": (2, 2, "replicated", False),
           "ep2": (2, 1, "ep", False), "tp2_cfg2_moe_tp": (4, 2, "tp", True), "ep2_cfg2_moe_ep": (4, 2, "ep", True),
           "tp4": (4, 1, "replicated", False)}


def loaded_bytes_on_rank(rank, world_size, model_dir, cfg, moe, vae):
    """This rank's model as run_image_gen loads it, summed by the plan's components."""
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model
    from utils.planner.memory_plan import COMPONENTS, component_of
    layout = Layout(world_size, cfg, moe, vae)
    context = RankContext(layout, rank, model_adaptor.apply("cpu"), text_to_image_only=True)
    model = load_model(model_dir, context)
    out = {component: 0 for component, _ in COMPONENTS}
    out["the rest"] = 0
    for name, tensor in model.state_dict().items():
        out[component_of(name)] += tensor.numel() * tensor.element_size()
    return layout.tp_rank(rank), out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_parameter_bytes_equal_the_loaded_model_exactly(tiny_model, name):
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan
    world_size, cfg, moe, vae = LAYOUTS[name]
    roles = plan(tiny_model, Layout(world_size, cfg, moe, vae), (64, 64), "cpu")
    assert sorted(r for role in roles for r in role.ranks) == list(range(world_size))
    role_of = {rank: role for role in roles for rank in role.ranks}
    if world_size == 1:
        loaded = [loaded_bytes_on_rank(0, 1, str(tiny_model), cfg, moe, vae)]
    else:
        loaded = run_ranks(world_size, loaded_bytes_on_rank, str(tiny_model), cfg, moe, vae)
    for rank, (tp_rank, measured) in enumerate(loaded):
        assert role_of[rank].params == measured, (name, rank)
    assert loaded[0][1]["vision encoder"] == 0 and loaded[0][1]["routed experts"] > 0


def test_the_real_models_config_plans_to_its_published_size():
    """config/real_model (written from public facts, config/real_model/SOURCES.md): 83.0 B parameters;
    on one rank the text-to-image model holds all but the vision tower and the VAE encoder."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import GiB, plan
    whole = plan("config/real_model", Layout(1), (1024, 1024), "npu")[0]
    assert 152 * GiB < whole.param_bytes < 154 * GiB            # 83.0 B less the vision tower and VAE encoder, bf16
    assert whole.params["routed experts"] == 77_309_411_328 * 2
    ep16 = plan("config/real_model", Layout(16, 2, "ep", True), (1024, 1024), "npu")
    assert len(ep16) == 1 and ep16[0].params["routed experts"] == 77_309_411_328 * 2 // 8


def run_plan(*argv):
    import contextlib
    import io
    from utils.planner import plan
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_plan_cli_reports_and_refuses_a_layout_that_does_not_fit(tiny_model):
    code, out, _ = run_plan("--model-id", tiny_model, "--world-size", "2", "--moe-ep", "--image-size", "64x64",
                            "--device", "cpu", "--device-memory", "8GiB")
    assert code == 0 and "ranks [0, 1]" in out and "routed experts" in out and "fits" in out
    code, out, err = run_plan("--model-id", tiny_model, "--world-size", "2", "--moe-ep", "--image-size", "64x64",
                              "--device", "cpu", "--device-memory", "200MiB")
    assert code == 2 and "DOES NOT FIT" in out
    assert err.startswith("error: device_memory: ranks [0, 1] need ") and "GiB short" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--device-memory", "lots"], "error: device-memory: 'lots' is not a memory size"),
    (["--world-size", "3", "--moe-ep"], "error: moe-ep: 4 experts"),
    (["--image-size", "big"], "error: image-size: 'big' is not HxW"),
])
def test_plan_cli_bad_input_is_one_line(tiny_model, argv, message):
    code, _, err = run_plan("--model-id", tiny_model, "--device", "cpu", *argv)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err


def test_run_sh_refuses_a_layout_that_does_not_fit_before_launch(tiny_model, tmp_path):
    from test_launcher import run_launcher, run_launcher_in_process, write_yaml
    job = {"world_size": 2, "master_port": 29611, "entry_script": "run_image_gen.py", "device_memory": "200MiB",
           "model_args": {"prompt": "x", "model-id": str(tiny_model), "device": "cpu", "moe-ep": True,
                          "image-size": "64x64"}}
    config = write_yaml(tmp_path, job)
    res = run_launcher(config, "--dry-run")
    assert res.returncode == 2 and "torch.distributed.run" not in res.stdout
    error = res.stderr.splitlines()
    assert len(error) == 1 and error[0].startswith("error: device_memory: ranks [0, 1] need ") and "short" in error[0]
    assert run_launcher(config, "--dry-run", "--no-plan").returncode == 0
    res = run_launcher(config, "--dry-run", "--device-memory", "16GiB")
    assert res.returncode == 0 and "plan: " in res.stderr and "torch.distributed.run" in res.stdout
    res = run_launcher_in_process(config, "--plan", "--device-memory", "16GiB")
    assert res.returncode == 0 and "activations" in res.stderr and "torch.distributed.run" not in res.stdout
    job["device_memory"] = "sixty"
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 2 and "error: device_memory: 'sixty' is not a memory size" in res.stderr


def test_plan_json_has_every_role(tiny_model, tmp_path):
    code, _, _ = run_plan("--model-id", tiny_model, "--world-size", "4", "--cfg-parallel", "--moe-tp",
                          "--image-size", "64x64", "--device", "cpu", "--json", tmp_path / "plan.json")
    roles = json.loads((tmp_path / "plan.json").read_text())
    assert code == 0 and sorted(r for role in roles for r in role["ranks"]) == [0, 1, 2, 3]
    assert all(role["total_bytes"] > role["param_bytes"] > 0 for role in roles)


# ---------------------------------------------------------------- Instruct and Distil checkpoints

VISION_PARAMS = 427_888_064 + 21_504_000       # SigLIP2 with its pooling head + the aligner (config/real_model/SOURCES.md)
VAE_ENCODER_PARAMS = 389_342_464


def loaded_instruct_bytes_on_rank(rank, world_size, model_dir):
    """loaded_bytes_on_rank with MoE EP and no CFG split (Distil cannot take one)."""
    return loaded_bytes_on_rank(rank, world_size, model_dir, 1, "ep", True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["instruct", "distil"])
def test_instruct_plans_equal_the_loaded_model_with_its_conditioning_encoders(request, kind):
    """The Instruct model keeps its vision tower, aligner and VAE encoder even for text-to-image
    jobs: the plan builds the Instruct file's class and counts them as loading holds them."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan
    model_dir = request.getfixturevalue(f"tiny_{kind}")
    roles = plan(model_dir, Layout(2, 1, "ep", True), (256, 256), "cpu")
    role_of = {rank: role for role in roles for rank in role.ranks}
    for rank, (_, measured) in enumerate(run_ranks(2, loaded_instruct_bytes_on_rank, str(model_dir))):
        assert role_of[rank].params == measured, (kind, rank)
        assert measured["vision encoder"] > 0 and measured["VAE encoder"] > 0, measured


def test_the_real_instruct_config_plans_the_vision_tower_and_vae_encoder():
    """config/real_instruct (the base's published config under the Instruct model file, SOURCES.md):
    the vision tower, its aligner and the VAE encoder at their published sizes, on every rank."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan
    whole = plan("config/real_instruct", Layout(1), (1024, 1024), "npu")[0]
    assert whole.params["vision encoder"] == VISION_PARAMS * 2
    assert whole.params["VAE encoder"] == VAE_ENCODER_PARAMS * 2
    assert whole.params["routed experts"] == 77_309_411_328 * 2


def test_conditioning_images_lengthen_the_instruct_context_and_distil_runs_one_branch(tmp_path):
    """Per conditioning image: the VAE latents of the base size's largest bucket (64 x 64 at 1024)
    and SigLIP2's max_num_patches (1024). The base model takes none; Distil has no CFG pair."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import TEXT_TOKENS, activation_bytes, conditioning_tokens, read_config
    config, raw = read_config("config/real_instruct")
    assert conditioning_tokens(config, raw, 1) == 64 * 64 + 1024
    assert conditioning_tokens(config, raw) == 3 * 5120           # the most a request brings
    base_config, base_raw = read_config("config/real_model")
    assert conditioning_tokens(base_config, base_raw) == 0
    image = 64 * 64
    kv = {images: activation_bytes(config, raw, Layout(1), (1024, 1024), "npu",
                                   TEXT_TOKENS + conditioning_tokens(config, raw, images))["KV cache"]
          for images in (0, 3)}
    assert kv[3] * (TEXT_TOKENS + image) == kv[0] * (TEXT_TOKENS + image + 3 * 5120)
    distil = tmp_path / "distil"
    distil.mkdir()
    (distil / "config.json").write_text(json.dumps({**raw, "cfg_distilled": True, "use_meanflow": True}))
    d_config, d_raw = read_config(distil)
    d_kv = activation_bytes(d_config, d_raw, Layout(1), (1024, 1024), "npu", TEXT_TOKENS)["KV cache"]
    assert 2 * d_kv == kv[0]
    from utils.planner.memory_plan import comm_per_step
    sent = {name: sum(comm_per_step(c, r, Layout(8), (1024, 1024)).values())
            for name, (c, r) in (("instruct", (config, raw)), ("distil", (d_config, d_raw)))}
    assert sent["instruct"] > 0 and 2 * sent["distil"] == sent["instruct"], sent      # one branch's rows cross


def test_plan_cli_says_the_context_and_refuses_images_for_the_base_model(tiny_model):
    from utils.planner.memory_plan import read_config
    from utils.planner.plan import conditioning_line
    assert conditioning_line(*read_config("config/real_instruct"), 2) == (
        "  context: 512 text tokens + 2 conditioning image(s), 10240 rows (5120 each: VAE latents + SigLIP2 tokens)"
        " + the image's")
    code, _, err = run_plan("--model-id", tiny_model, "--device", "cpu", "--conditioning-images", "1")
    assert code == 2 and err.startswith("error: conditioning-images: 1 given, but this is a base checkpoint")
    code, _, err = run_plan("--model-id", "config/real_instruct", "--conditioning-images", "4", "--fit-table", "1GiB")
    assert code == 2 and err.startswith("error: conditioning-images: 4 is outside 0..3"), err


EXPERT_PARAMS = 77_309_411_328                 # the real model's routed expert parameters (32 layers x 64 experts)
EXPERT_SCALES = 32 * 64 * (2 * 3072 + 4096)    # float32 per output channel: w13 [2I] + w2 [H] per expert


def test_8bit_experts_plan_at_one_byte_per_parameter_plus_scales():
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import GiB, plan
    for fmt in ("int8", "fp8"):
        whole = plan("config/real_model", Layout(1), (1024, 1024), "npu", fmt)[0]
        assert whole.params["routed experts"] == EXPERT_PARAMS + EXPERT_SCALES * 4, fmt
        assert 80 * GiB < whole.param_bytes < 82 * GiB, fmt           # 153 GiB in bf16, less 72 GiB of experts
        assert whole.read_bytes > whole.param_bytes                   # a bf16 checkpoint quantized while loading


def test_8bit_plan_of_the_tiny_model_equals_the_model_built_for_real(tiny_model):
    """The meta model the planner sums is the same module tree, dtypes and all, as one built on the CPU."""
    import torch
    import model_adaptor
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.parallel.context import RankContext, building
    from adaptor_patches.parallel.layout import Layout
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    from utils.planner.memory_plan import parameter_bytes, plan, read_config
    config, _ = read_config(tiny_model)
    planned = plan(tiny_model, Layout(1), (64, 64), "cpu", "int8")[0].params
    model_adaptor.apply(Device("cpu"))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with building(RankContext(Layout(1), 0, Device("cpu"), text_to_image_only=True, expert_format="int8")):
            built = HunyuanImage3ForCausalMM(config)
    finally:
        torch.set_default_dtype(default)
        model_adaptor.remove()
    assert parameter_bytes(built) == planned
    experts = {name: t.dtype for name, t in built.state_dict().items() if ".mlp.experts." in name}
    assert set(experts.values()) == {torch.int8, torch.float32}


@pytest.mark.slow
def test_8bit_experts_halve_the_fewest_cards_of_the_real_model():
    """The targets of issue 22: in 8 bit the real model fits one 141 GB device and two 64 GB devices;
    in bf16 it needs two and four."""
    from utils.planner.plan import fewest_cards, parse_memory
    fewest = {(q, m): fewest_cards("config/real_model", parse_memory(m), (1024, 1024), "npu", q)[0]
              for q in (None, "int8") for m in ("64GB", "141GB")}
    assert fewest == {(None, "64GB"): 4, (None, "141GB"): 2, ("int8", "64GB"): 2, ("int8", "141GB"): 1}


def test_run_sh_plans_with_the_jobs_quantize(tiny_model, tmp_path):
    from adaptor_patches.parallel.layout import Layout
    from test_launcher import run_launcher, write_yaml
    from utils.planner.memory_plan import plan
    bf16, int8 = (plan(tiny_model, Layout(1), (64, 64), "cpu", q)[0].total() for q in (None, "int8"))
    assert int8 < bf16
    memory = int((bf16 + int8) / 2 / 0.95)                  # between the two, after the 5 % headroom
    job = {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py", "device_memory": memory,
           "model_args": {"prompt": "x", "model-id": str(tiny_model), "device": "cpu", "image-size": "64x64"}}
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 2 and "error: device_memory: ranks [0] need" in res.stderr
    job["model_args"]["quantize"] = "int8"
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 0 and "plan: " in res.stderr, res.stderr


@pytest.mark.slow
def test_the_designs_table_plans_the_conditioning_images_asked_for():
    """The designs of issue 29 are planned with the same context as the plan above them: fewer
    conditioning images, less memory per rank (the bytes sent per step do not depend on the context)."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.plan import design_rows
    rows = {images: design_rows("config/real_instruct", Layout(8, 1, "ep", True), (1024, 1024), "npu",
                                conditioning_images=images) for images in (0, 3)}
    built = [(few, most) for few, most in zip(rows[0], rows[3]) if few[3] is not None]
    assert built and all(few[3] < most[3] and few[2] == most[2] for few, most in built), rows


def test_the_text_decode_step_moves_one_all_reduce_per_moe_layer():
    """The text phase's decode step (adaptor_patches/text/decode.py: one token per sequence, every row on
    every rank, the MoE's fixed-shape form) on ep8_cfg.yaml's layout of the real Instruct model: per
    MoE layer ONE all-reduce of B x hidden bf16 over the EP group, where today's loop has the counts
    all-to-all, two row all-to-alls and an all-gather; per layer attention TP's all-reduce; the token
    broadcast over the world; no CFG collective. The planner reports it as a phase of its own."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan, read_config, traffic_by_phase
    from utils.planner.traffic import BF16, INT64, TEXT_DECODE, Sizes, text_decode_lines
    config, raw = read_config("config/real_instruct")
    sizes = Sizes.of(config, raw)
    ep8_cfg = Layout.from_flags(16, cfg_parallel=True, moe_ep=True, vae_parallel=True)
    for rows in (1, 2):
        row = rows * 4096 * BF16
        lines = [(l.purpose, l.kind, l.degree, l.payload, l.calls) for l in text_decode_lines(sizes, ep8_cfg, rows)]
        assert lines == [("attention TP all-reduce", "all_reduce", 8, row, 32),
                         ("MoE EP all-reduce (fixed shape)", "all_reduce", 8, row, 32),
                         ("token broadcast", "broadcast", 16, rows * INT64, 1)], lines
    today = {(l.kind, l.purpose.split(" (")[0]) for l in text_decode_lines(sizes, ep8_cfg, 1, loop="transformers")}
    assert {("all_to_all", "MoE EP counts all-to-all"), ("all_gather", "MoE EP all-gather")} <= today, today
    ulysses = text_decode_lines(sizes, Layout.from_flags(8, moe_tp=True, ulysses=4), 1)
    assert [(l.purpose, l.degree, l.calls) for l in ulysses] == [
        ("Ulysses decode all-reduce (o_proj)", 8, 32), ("MoE TP all-reduce (fixed shape)", 8, 32), ("token broadcast", 8, 1)]
    assert text_decode_lines(sizes, Layout.from_flags(2, cfg_parallel=True), 1)[0].kind == "broadcast"
    role = plan("config/real_instruct", ep8_cfg, (1024, 1024), "npu")[0]
    assert role.traffic[TEXT_DECODE] == {"attention TP all-reduce": 448 * 1024, "MoE EP all-reduce (fixed shape)":
                                         448 * 1024, "token broadcast": 15 * INT64}      # 8192 B x 2 x 7/8 x 32
    assert plan("config/real_model", ep8_cfg, (1024, 1024), "npu")[0].traffic[TEXT_DECODE] == {}   # no think text
    batched = traffic_by_phase(config, raw, ep8_cfg, (1024, 1024), batch=2)[TEXT_DECODE]    # rows decoded together
    assert batched["MoE EP all-reduce (fixed shape)"] == 2 * 448 * 1024, batched


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "int4-g32"])
def test_a_meta_build_stores_experts_as_quantizing_them_does(fmt):
    """The planner's meta build skips the quantize arithmetic (moe/experts.meta_stored): each stored
    tensor must have the shape and dtype quantize_weight gives a real weight of that shape."""
    from adaptor_patches.kernels.quant import quantize_weight
    from adaptor_patches.moe.experts import meta_stored
    weight = torch.randn(3, 128, 96)
    real = quantize_weight(weight, fmt)
    meta = meta_stored(weight.to("meta"), fmt)
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in real]
    assert all(t.is_meta for t in meta)


def test_layouts_that_hold_the_same_weights_share_one_meta_build(tiny_model, monkeypatch):
    """memory_plan.rank_weights builds once per split of the weights (Layout.weights): CFG parallel and
    VAE parallel add no build, a different MoE split does."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner import memory_plan
    built = []
    original = memory_plan.build_meta_model
    monkeypatch.setattr(memory_plan, "build_meta_model", lambda *a, **k: built.append(a[2]) or original(*a, **k))
    monkeypatch.setattr(memory_plan, "_RANK_WEIGHTS", {})
    first = memory_plan.plan(tiny_model, Layout(2, moe="ep"), (64, 64), "cpu")
    again = memory_plan.plan(tiny_model, Layout(4, 2, "ep", True), (64, 64), "cpu")
    assert len(built) == 2 and [r.params for r in first] == [r.params for r in again]
    memory_plan.plan(tiny_model, Layout(2, moe="tp"), (64, 64), "cpu")
    assert len(built) == 4


def test_the_instruct_plan_counts_the_text_phase_and_the_vae_encoders_frames():
    """Issue 48 (the dry run's tracked peaks): the VAE encoder expands an image to ffactor_temporal frames
    and its swish holds four maps (fp16 input + 3 fp32 under CUDA's autocast, bf16 on NPU); the text
    prefill keeps bf16 and fp32 logits of each row's last position (forward_context.logits_rows); the
    text KV lives beside the image call."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import TEXT_TOKENS, RolePlan, activation_bytes, conditioning_tokens, read_config
    config, raw = read_config("config/real_instruct")
    rows = TEXT_TOKENS + conditioning_tokens(config, raw, 1)
    acts = {kind: activation_bytes(config, raw, Layout(1), (1024, 1024), kind, rows, conditioning_images=1)
            for kind in ("cuda", "npu")}
    full_res = 4 * 128 * 1024 * 1024                           # frames x channels x pixels
    assert acts["cuda"]["conditioning encode"] == full_res * (2 + 3 * 4)
    assert acts["npu"]["conditioning encode"] == full_res * 4 * 2
    assert acts["cuda"]["VAE decode"] == full_res * 4 * 4 and acts["npu"]["VAE decode"] == full_res * 4 * 2
    assert acts["npu"]["text prefill"] == config.vocab_size * (2 + 4)
    kv_row = 32 * 2 * 8 * 128 * 2
    assert acts["npu"]["text KV"] == (8 * 1024 + rows + TEXT_TOKENS) * kv_row    # capacity: 5632 + 2048 rounded up
    role = RolePlan(0, [0], {}, 0, acts["cuda"], {})
    image = acts["cuda"]["VAE decode"] + acts["cuda"]["KV cache"]
    assert role.activation_bytes == max(image, acts["cuda"]["conditioning encode"]) + acts["cuda"]["text KV"]
    base_config, base_raw = read_config("config/real_model")
    base = activation_bytes(base_config, base_raw, Layout(1), (1024, 1024), "npu", TEXT_TOKENS)
    assert "text prefill" not in base and "text KV" not in base
