"""Every kernel of the device's kernel set against the torch reference, at the model's shapes.

The device's set (kernels_for: npu_* fused ops on Ascend, torch._grouped_mm on CUDA, the padded
bmm on CPU) runs in bf16, as the model does; the reference is LoopKernels (one matmul per expert,
SDPA) in fp32 on the same inputs and the same device. Error = max |out - ref| / max |ref|. Index
ops (permute, regroup) must match exactly. A set that inherits an op from the reference is
still run: the check then covers the device's own torch kernels.
"""
from __future__ import annotations

import torch

from adaptor_patches.kernels.torch_kernels import LoopKernels

from . import Result, judged

SECTION = "kernels"
BF16_LIMIT = 2e-2      # a few bf16 ulps (7.8e-3) at the output's magnitude, after K-way accumulation


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12)).item()


def _inputs(shape: dict, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, e, k, i, t = (shape[n] for n in ("hidden", "experts", "topk", "intermediate", "tokens"))

    def rand(*size, std=1.0):
        return (torch.randn(*size, generator=g) * std).to(device=device, dtype=torch.bfloat16)

    logits = torch.randn(t, e, generator=g).to(device)
    topk_weight, topk_idx = LoopKernels().route(logits, k, True, 1.0)
    return dict(x=rand(t, h), w13=rand(e, h, 2 * i, std=h ** -0.5), w2=rand(e, i, h, std=i ** -0.5),
                gate_and_up=rand(2 * i, h, std=h ** -0.5), down=rand(h, i, std=i ** -0.5),
                topk_weight=topk_weight, topk_idx=topk_idx, g=g)


def _attention_inputs(shape: dict, device: torch.device, g: torch.Generator):
    """q, k, v (BNSD) and upstream's bool mask (True = attend): causal over the text, the image
    block attending to itself fully, as in one image-generation forward."""
    seq = shape["text_tokens"] + shape["tokens"]
    q, k, v = (torch.randn(1, heads, seq, shape["head_dim"], generator=g).to(device=device, dtype=torch.bfloat16)
               for heads in (shape["heads"], shape["kv_heads"], shape["kv_heads"]))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    start = shape["text_tokens"]
    mask[start:, start:] = True
    return q, k, v, mask.to(device)[None, None]


def kernel_checks(kernels, device: torch.device, shape: dict) -> list:
    """One Result per kernel: `kernels` (bf16) against LoopKernels (fp32) on `device`."""
    ref, inp = LoopKernels(), _inputs(shape, device)
    x, w13, w2 = inp["x"], inp["w13"], inp["w2"]
    topk_weight, topk_idx = inp["topk_weight"], inp["topk_idx"]
    f32 = {name: t.float() for name, t in inp.items() if torch.is_tensor(t) and t.is_floating_point()}
    name = f"{kernels.name} vs loop(fp32)"
    results = []

    def compare(check, run_device, run_ref, detail=""):
        try:
            out, expected = run_device(), run_ref()
        except Exception as exc:                                # an op that raises is a failed check
            results.append(Result(SECTION, check, "fail", detail=f"{type(exc).__name__}: {exc}"[:300]))
            return
        results.append(judged(SECTION, check, _rel_err(out, expected), BF16_LIMIT, detail or name))

    # permute: the same token copies grouped by the same experts (exact), counts exact
    try:
        sorted_x, row_idx, counts = kernels.permute(x, topk_idx, shape["experts"])
        ref_sorted, ref_row_idx, ref_counts = ref.permute(x, topk_idx, shape["experts"])
        exact = (torch.equal(counts.cpu(), ref_counts.cpu())
                 and torch.equal(sorted_x.index_select(0, row_idx.long()), x.repeat_interleave(shape["topk"], 0)))
        results.append(Result(SECTION, "permute (init_routing)", "pass" if exact else "fail", 0 if exact else 1, 0,
                              "rows per expert and row index exact" if exact else "rows or counts differ"))
    except Exception as exc:
        results.append(Result(SECTION, "permute (init_routing)", "fail", detail=f"{type(exc).__name__}: {exc}"[:300]))
        ref_sorted, ref_row_idx, ref_counts = ref.permute(x, topk_idx, shape["experts"])

    compare("grouped_matmul (gate/up)", lambda: kernels.grouped_matmul(ref_sorted, w13, ref_counts),
            lambda: ref.grouped_matmul(ref_sorted.float(), f32["w13"], ref_counts))
    gate_up = ref.grouped_matmul(ref_sorted.float(), f32["w13"], ref_counts)
    compare("swiglu", lambda: kernels.swiglu(gate_up.to(torch.bfloat16)),
            lambda: ref.swiglu(gate_up.to(torch.bfloat16).float()))
    expert_out = ref.expert_mlp(ref_sorted.float(), f32["w13"], f32["w2"], ref_counts)
    compare("unpermute (finalize_routing)",
            lambda: kernels.unpermute(expert_out.to(torch.bfloat16), ref_row_idx, topk_weight),
            lambda: ref.unpermute(expert_out.to(torch.bfloat16).float(), ref_row_idx, topk_weight))
    compare("shared_mlp", lambda: kernels.shared_mlp(x, inp["gate_and_up"], inp["down"]),
            lambda: ref.shared_mlp(f32["x"], f32["gate_and_up"], f32["down"]))
    compare("routed_experts (whole MoE path)", lambda: kernels.routed_experts(x, topk_weight, topk_idx, w13, w2),
            lambda: ref.routed_experts(f32["x"], topk_weight, topk_idx, f32["w13"], f32["w2"]))
    results.append(_regroup_check(kernels, ref, ref_sorted, shape, inp["g"]))
    q, k, v, mask = _attention_inputs(shape, device, inp["g"])
    compare("attention (masked, GQA)", lambda: kernels.attention(q, k, v, mask),
            lambda: ref.attention(q.float(), k.float(), v.float(), mask))
    return results


def _regroup_check(kernels, ref, rows: torch.Tensor, shape: dict, g: torch.Generator) -> Result:
    """EP: rows arriving from 4 ranks grouped (source rank, local expert), regrouped by expert; exact."""
    check = "regroup (re_routing, EP)"
    try:
        ranks, local = 4, max(shape["experts"] // 4, 1)
        cut = torch.sort(torch.randint(0, rows.shape[0] + 1, (ranks * local - 1,), generator=g)).values
        bounds = torch.cat([torch.tensor([0]), cut, torch.tensor([rows.shape[0]])])
        counts_per_rank = (bounds[1:] - bounds[:-1]).view(ranks, local).to(rows.device)
        grouped, order, local_counts = kernels.regroup(rows, counts_per_rank)
        ref_grouped, _, ref_local = ref.regroup(rows, counts_per_rank)
        exact = torch.equal(grouped, ref_grouped) and torch.equal(local_counts.cpu(), ref_local.cpu()) \
            and torch.equal(kernels.ungroup(grouped, order), rows)
    except Exception as exc:
        return Result(SECTION, check, "fail", detail=f"{type(exc).__name__}: {exc}"[:300])
    return Result(SECTION, check, "pass" if exact else "fail", 0 if exact else 1, 0,
                  "grouped rows, counts and inverse exact" if exact else "rows, counts or inverse differ")
