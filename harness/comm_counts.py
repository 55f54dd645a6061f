"""One image per layout on real gloo ranks, its collectives counted, and the planner's lines for it.

bench/comm.py prints the counted bytes against the planner's; tests/test_comm.py checks them within
2 %; tests/test_int8_dispatch.py loads and generates through the same two functions.

    counted = run_ranks(world_size, count_on_rank, model_dir, layout_args, size, steps, experts)
    planned = planned_for(model_dir, layout_args, world_size, size, counted, dispatch_of(spec))

`experts` is None (the device's kernel set, bf16 experts) or a module-level callable returning
(kernel set, expert format): LAYOUTS' W8A8 layouts run the NPU kernel set computing W8A8 with int8
experts, which off an NPU means its CPU double (tests/npu_double.w8a8_experts).
"""
from __future__ import annotations

PROMPT = "a red fox standing in fresh snow"
W8A8 = "int8-w8a8"          # LAYOUTS' experts: the NPU set computing W8A8, int8 experts (EP rows sent as int8)
# name -> (world size, Layout's (cfg, moe, vae_parallel[, ulysses]), experts: None | W8A8)
LAYOUTS = {"tp2": (2, (1, "replicated", False), None), "ep2": (2, (1, "ep", False), None),
           "tp2_cfg2_moe_tp": (4, (2, "tp", True), None), "ep2_cfg2_moe_ep": (4, (2, "ep", True), None),
           "u2_cfg2_moe_ep": (4, (2, "ep", True, 2), None), "u2_tp2_moe_tp": (4, (1, "tp", False, 2), None),
           "u2_cfg2_moe_ep_int8": (4, (2, "ep", True, 2), W8A8)}


def dispatch_of(spec) -> str:
    """The EP rows' format on the wire for LAYOUTS' experts `spec`."""
    return "int8" if spec == W8A8 else "bf16"


def load_rank_model(rank: int, world_size: int, model_dir, layout_args: tuple, device=None, kernels=None,
                    expert_format=None):
    """(model, context) of this rank, loaded as run_image_gen loads it (text to image only)."""
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.parallel.layout import Layout
    from utils.runtime.engine import rank_model
    return rank_model.load_rank_model(model_dir, device or Device("cpu"), layout=Layout(world_size, *layout_args),
                                      rank=rank, text_to_image_only=True, kernels=kernels, expert_format=expert_format)


def generate(model, size: int, steps: int, step_cache=None):
    """One image, as run_image_gen generates it (the step cache's run around it when given)."""
    from adaptor_patches import step_cache as cache
    with cache.running(model, step_cache, steps):
        return model.generate_image(prompt=PROMPT, seed=7, image_size=f"{size}x{size}", diff_infer_steps=steps,
                                    verbose=0)


def count_on_rank(rank: int, world_size: int, model_dir, layout_args: tuple, size: int, steps: int,
                  experts=None) -> dict:
    """This rank's recorder summary of one image (multirank.run_ranks calls it on every rank)."""
    import torch
    from utils.planner.comm_recorder import CollectiveRecorder
    kernels, expert_format = experts() if experts is not None else (None, None)
    with torch.no_grad():
        model, context = load_rank_model(rank, world_size, model_dir, layout_args, kernels=kernels,
                                         expert_format=expert_format)
        with CollectiveRecorder(context.device.torch_device) as recorder:
            recorder.attach(model)
            generate(model, size, steps)
    return recorder.summary()


def planned_for(model_dir, layout_args: tuple, world_size: int, size: int, counted: list,
                dispatch: str = "bf16") -> list:
    """Every rank's planned lines for the run `counted` describes (its first step's sequence length)."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import read_config
    from utils.planner.traffic import FIRST_STEP, image_lines
    config, raw = read_config(model_dir)
    layout = Layout(world_size, *layout_args)
    first = counted[0]["forward_rows"][FIRST_STEP][0]
    return [image_lines(config, raw, layout, (size, size), layout.tp_rank(r), layout.cfg_rank(r),
                        first_step_rows=first, device_kind="cpu", dispatch=dispatch)
            for r in range(world_size)]
