"""adaptor_patches/moe_cpu_native.py and csrc/moe_cpu_kernels.c: build, cache, fallback, and the
C passes' arithmetic against torch. (Whole-kernel equivalence of the CPU form, C passes on and
off: test_ops.py; the layer against upstream eager: test_moe_layer.py.)"""
import ctypes
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adaptor_patches import moe_cpu_native, ops


def _lib():
    lib = moe_cpu_native.library()
    assert lib is not None, f"the C kernels must build on this machine: {moe_cpu_native.failure}"
    return lib


def test_kernels_build_once_and_are_cached_by_content():
    lib = _lib()
    path = lib._name
    assert moe_cpu_native.library() is lib
    assert path.endswith(".so") and "moe_cpu_kernels-" in path
    assert moe_cpu_native._build() == Path(path)                         # same hash, no rebuild


def test_silu_pass_matches_torch_over_the_whole_float_range():
    g = torch.cat([torch.linspace(-120, 120, 200_001), torch.tensor([0.0, math.inf, math.nan])])
    rows = torch.stack([g, torch.full_like(g, 1.5)], 1).contiguous()      # [gate | up], inter = 1
    out = torch.empty_like(g)
    _lib().moe_swiglu(rows.data_ptr(), g.numel(), 1, 1, None, out.data_ptr(), 1)
    ref = F.silu(g.double()) * 1.5
    finite = torch.isfinite(ref) & (ref.abs() > 1e-30)
    rel = ((out.double() - ref).abs() / ref.abs())[finite]
    assert rel.max() < 4e-7                                   # ~2 ulp; torch's own silu is ~1 ulp here
    assert out[-3] == 0 and out[-2] == math.inf and math.isnan(out[-1])


def test_combine_weights_and_sums_each_tokens_rows_in_place():
    g = torch.Generator().manual_seed(0)
    tokens, topk, hidden, slots = 5, 3, 7, 20
    down = torch.randn(slots, hidden, generator=g)
    slot_of_row = torch.randperm(slots, generator=g)[:tokens * topk].contiguous()
    weight = torch.rand(tokens * topk, generator=g)
    out = torch.randn(tokens, hidden, generator=g)
    rows = down.double()[slot_of_row].view(tokens, topk, -1)
    ref = out.double() + (weight.double().view(tokens, topk, 1) * rows).sum(1)
    _lib().moe_combine(down.data_ptr(), hidden, slot_of_row.data_ptr(), weight.data_ptr(), tokens, topk, out.data_ptr())
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)


def test_slots_keep_each_experts_rows_in_row_order_and_pads_empty():
    idx = torch.tensor([[2, 0], [0, 1], [2, 0]])                       # rows 0..5: experts 2 0 0 1 2 0
    lib = _lib()
    counts = torch.empty(3, dtype=torch.int64)
    largest = lib.moe_count(idx.view(-1).data_ptr(), 6, 3, counts.data_ptr())
    assert largest == 3 and counts.tolist() == [3, 1, 2]
    token_of_slot, slot_of_row, fill = (torch.empty(9, dtype=torch.int64), torch.empty(6, dtype=torch.int64),
                                        torch.empty(3, dtype=torch.int64))
    lib.moe_slots(idx.view(-1).data_ptr(), 6, 2, 3, 3, fill.data_ptr(), token_of_slot.data_ptr(),
                  slot_of_row.data_ptr())
    assert token_of_slot.tolist() == [0, 1, 2, 1, -1, -1, 0, 2, -1]
    assert slot_of_row.tolist() == [6, 0, 1, 3, 7, 2]
    assert lib.moe_count(torch.tensor([0, 3]).data_ptr(), 2, 3, counts.data_ptr()) == -1   # out of range


def test_without_a_compiler_the_cpu_form_warns_once_and_runs_eager_ops(monkeypatch):
    monkeypatch.setattr(moe_cpu_native, "_library", None)
    monkeypatch.setattr(moe_cpu_native, "_tried", False)
    monkeypatch.setattr(moe_cpu_native, "failure", None)
    monkeypatch.setattr(moe_cpu_native.shutil, "which", lambda name: None)
    g = torch.Generator().manual_seed(1)
    x, w13, w2 = torch.randn(24, 8, generator=g), torch.randn(4, 8, 12, generator=g), torch.randn(4, 6, 8, generator=g)
    weight, idx = ops.route(torch.randn(24, 4, generator=g), 2, True, 1.0)
    with warnings.catch_warnings(record=True) as caught, ops.use_form("cpu"), torch.no_grad():
        warnings.simplefilter("always")
        out = ops.routed_experts(x, weight, idx, w13, w2)
        ops.routed_experts(x, weight, idx, w13, w2)
    assert [str(w.message) for w in caught] == [
        "moe_cpu: fused C kernels unavailable (no C compiler found (set CC)); using eager torch ops"]
    with ops.use_form("loop"):
        assert torch.allclose(out, ops.routed_experts(x, weight, idx, w13, w2), rtol=1e-5, atol=1e-6)


def test_a_new_build_replaces_the_builds_of_earlier_sources(monkeypatch, tmp_path):
    (tmp_path / "moe_cpu_kernels-0123456789abcdef.so").write_bytes(b"stale")
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(moe_cpu_native, "SOURCE", source)
    monkeypatch.setattr(moe_cpu_native, "_cache_dir", lambda: tmp_path)
    built = moe_cpu_native._build()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["k.c", built.name])
    assert ctypes.CDLL(str(built)).answer() == 42


def test_a_failed_build_leaves_no_library_file(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(moe_cpu_native, "SOURCE", broken)
    monkeypatch.setattr(moe_cpu_native, "_cache_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="failed"):
        moe_cpu_native._build()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.c"]


def test_with_autograd_the_cpu_form_keeps_the_graph_and_its_gradients_are_right():
    """The C passes, out= and reused buffers would cut the graph: ops.py must not use them then."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, generator=g)
    w13 = torch.randn(4, 8, 12, generator=g, requires_grad=True)
    w2 = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    gate_and_up = torch.randn(12, 8, generator=g, requires_grad=True)
    down = torch.randn(8, 6, generator=g, requires_grad=True)
    weight, idx = ops.route(torch.randn(16, 4, generator=g), 2, True, 1.0)
    with ops.use_form("cpu"):
        (ops.routed_experts(x, weight, idx, w13, w2) + ops.shared_mlp(x, gate_and_up, down)).square().sum().backward()
    params = (w13, w2, gate_and_up, down)
    grads = [p.grad.clone() for p in params]
    doubles = [p.detach().double().requires_grad_() for p in params]
    ref = ops.shared_mlp(x.double(), doubles[2], doubles[3])
    for t in range(16):
        for k in range(2):
            gate, up = (x[t].double() @ doubles[0][idx[t, k]]).chunk(2)
            ref[t] = ref[t] + weight[t, k].double() * ((F.silu(gate) * up) @ doubles[1][idx[t, k]])
    ref.square().sum().backward()
    for param, grad, double in zip(("w13", "w2", "gate_and_up", "down"), grads, doubles):
        assert torch.allclose(grad.double(), double.grad, rtol=1e-4, atol=1e-4), param


def test_bf16_swiglu_rounds_like_torchs_bf16_ops():
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(4096, 2 * 64, generator=g) * 4).to(torch.bfloat16)      # [gate | up], inter = 64
    out = torch.empty(4096, 64, dtype=torch.bfloat16)
    _lib().moe_swiglu_bf16(rows.data_ptr(), 4096, 64, 1, None, out.data_ptr(), 64)
    gate, up = rows.chunk(2, dim=-1)
    ref = F.silu(gate) * up                                  # torch: silu rounded to bf16, then the product
    differ = out != ref
    # The fp32 silu differs from torch's by ~1 ulp, which can flip a bf16 rounding now and then.
    assert differ.float().mean() < 1e-3
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7)[differ].all()


def test_bf16_combine_sums_in_fp32_and_rounds_once():
    g = torch.Generator().manual_seed(4)
    tokens, topk, hidden, slots = 6, 4, 1500, 30                 # hidden > 1024: the C loop's chunking
    down = torch.randn(slots, hidden, generator=g).to(torch.bfloat16)
    slot_of_row = torch.randperm(slots, generator=g)[:tokens * topk].contiguous()
    weight = torch.rand(tokens * topk, generator=g)
    out = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    exact = out.double() + (weight.double().view(tokens, topk, 1)
                            * down.double()[slot_of_row].view(tokens, topk, -1)).sum(1)
    _lib().moe_combine_bf16(down.data_ptr(), hidden, slot_of_row.data_ptr(), weight.data_ptr(), tokens, topk,
                            out.data_ptr())
    assert torch.equal(out, exact.float().to(torch.bfloat16))   # fp32 sum is exact enough to round the same
