"""The MoE's EP rows crossing ranks as int8 where the experts compute W8A8 (issue 29: moe/dispatch.py,
kernels/quant.py DISPATCH_FORMATS, the NPU set's permute_quantized / regroup_quantized /
quantized_rows_matmul).

Runs the NPU kernel set through its CPU double (tests/npu_double.py) with int8 experts computing
W8A8, as an NPU would, on 4 real gloo ranks: CFG2 x (Ulysses 2 + MoE EP2), sequence shares, VAE
parallel, on the gained checkpoint. Under W8A8 the experts quantize their input rows per token on
arrival (npu_dynamic_quant); int8 dispatch quantizes them before the all-to-all instead (the
routing op's dynamic quant, the same formula), so the image must be bit-identical to the same
layout sending bf16 rows, and within test_layouts' bounds of the single process with the same
kernels and experts. The dispatch all-to-all must carry int8 rows of hidden + 4 bytes.

Mutations checked: the scales unpacked from the wrong 4 bytes (the first 4 of each row: image off
by far), the experts handed the int8 rows without their scales (dequantized as scale 1: off by
far), dispatch_format left at bf16 on the NPU W8A8 set (the row-width check fails).
"""
import numpy as np
import pytest
import torch

from harness.multirank import run_ranks
from test_layouts import PSNR_MIN_DB

LAYOUT = (2, "ep", True, 2)              # cfg, moe, vae_parallel, ulysses: on 4 ranks
SIZE, STEPS = 64, 3


def _image_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def images_on_rank(rank, world_size, model_dir):
    """({run: image}: int8 dispatch, bf16 rows, and on rank 0 the single process; {run: {(dtype, width)
    of the rows each dispatch all-to-all sent}})."""
    import model_adaptor
    from adaptor_patches.moe import dispatch
    import npu_double
    from harness.comm_counts import generate, load_rank_model
    from utils.planner.comm_recorder import CollectiveRecorder
    widths, out, run = {}, {}, [None]
    original = dispatch.ExpertParallel._experts_across_ranks

    def recording(self, experts, sorted_x, counts, dtype, adapters=None):
        widths.setdefault(run[0], set()).add((str(sorted_x.dtype), sorted_x.shape[1]))
        return original(self, experts, sorted_x, counts, dtype, adapters)

    try:
        dispatch.ExpertParallel._experts_across_ranks = recording
        with torch.no_grad():
            for name in ("int8", "bf16"):
                run[0] = name
                model, context = load_rank_model(rank, world_size, model_dir, LAYOUT, None, *npu_double.w8a8_experts())
                if name == "bf16":                  # the same layout, its rows sent as bf16
                    for layer in model.model.layers:
                        if isinstance(getattr(layer.mlp, "dispatcher", None), dispatch.ExpertParallel):
                            layer.mlp.dispatcher.dispatch = "bf16"
                with CollectiveRecorder(context.device.torch_device):
                    out[name] = _image_array(generate(model, SIZE, STEPS))
                del model
                model_adaptor.remove()
            if rank == 0:                           # the single process, same kernels and experts
                model, _ = load_rank_model(0, 1, model_dir, (1, "replicated", False), None, *npu_double.w8a8_experts())
                out["single"] = _image_array(generate(model, SIZE, STEPS))
    finally:
        dispatch.ExpertParallel._experts_across_ranks = original
        model_adaptor.remove()
    return out, widths


@pytest.mark.slow
def test_int8_dispatch_computes_what_w8a8_computes_and_sends_int8_rows(gained_model):
    import json
    hidden = json.loads((gained_model / "config.json").read_text())["hidden_size"]
    per_rank = run_ranks(4, images_on_rank, str(gained_model), timeout_s=900)
    images = per_rank[0][0]
    db = _psnr(images["int8"], images["single"])
    print(f"int8 dispatch vs single process (W8A8 int8 experts, NPU double): {db:.1f} dB")
    assert np.array_equal(images["int8"], images["bf16"]), "int8 dispatch changed the image"
    assert db >= PSNR_MIN_DB, db
    for _, widths in per_rank:
        assert widths == {"int8": {("torch.int8", hidden + 4)}, "bf16": {("torch.bfloat16", hidden)}}, widths
