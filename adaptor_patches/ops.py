"""The kernels (MoE, attention), each with a fused NPU form and a plain-torch form.

    routed_experts(x, topk_weight, topk_idx, w13, w2)   the whole routed path of one MoE layer
    expert_mlp(sorted_x, w13, w2, counts)  down(SwiGLU(gate/up(rows))) per expert group
    shared_mlp(x, gate_and_up, down)       upstream HunyuanMLP's math on its nn.Linear weights
    grouped_matmul(x, w, counts)           rows of x grouped by expert; w is [E, in, out]
    route(logits, topk, norm, scale)       upstream topkgating's combine weights, dropless
    permute(x, topk_idx, num_experts)      token copies sorted by expert (+ per-expert counts)
    unpermute(y, row_idx, topk_weight)     weighted sum of each token's K expert rows
    regroup(x, counts_per_rank)            EP: rows grouped (source rank, expert) -> by expert
    ungroup(y, order)                      inverse of regroup
    swiglu(x)                              silu(first half) * second half
    attention(q, k, v, mask, scale)        GQA attention, upstream's bool mask (True = attend)

Forms (one is chosen per device kind, once; call sites never branch on the device):
  "npu"         torch_npu.npu_grouped_matmul / npu_moe_init_routing_v2 / npu_moe_finalize_routing /
                npu_moe_re_routing / npu_swiglu / npu_fused_infer_attention_score. Written from the
                torch_npu 2.13 schemas and the Ascend docs; NOT run on Ascend hardware. Tested on
                CPU against npu_double.py.
  "grouped_mm"  (CUDA) torch._grouped_mm (CPU: fp32/bf16/fp16; CUDA: bf16 only, not run on CUDA
                here) when strides are 16-byte aligned, else the loop; the rest in plain torch.
  "cpu"         (CPU) "grouped_mm", except that, when autograd records nothing, routed_experts
                runs moe_cpu.py's padded bmm (fused C passes around it) when the expert
                groups are nearly equal, and shared_mlp keeps its gate/up output in a reused
                buffer. CPU only by default: reused buffers and C passes suit no other device.
  "loop"        one matmul per expert; the reference the other forms are tested against.

`use_form("loop")` (a context manager) forces a form; `use_form("npu", npu_ops=npu_double)` runs
the NPU call sites on CPU against the test double.

Empty input (an EP rank whose token chunk or received rows are empty: decode steps have one token
per CFG branch) never reaches a kernel: every function here returns its empty result from the
host-known shape first. Ascend documents empty tensors as unsupported for npu_swiglu and leaves
them undocumented for grouped matmul and the routing ops, so no form calls them with zero rows.

Host syncs: none in the "npu" and "grouped_mm" forms; one `.tolist()` of the counts per grouped
matmul in "loop", one per layer in "cpu" (free on CPU, where there is no device queue).
SwiGLU convention: silu is applied to the FIRST half, as npu_swiglu does. Upstream's HunyuanMLP
computes x1 * silu(x2) (second half activated); moe_weights.py swaps the halves once at load time
so the stacked expert weights produce [x2 | x1] and this function equals upstream's.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from . import moe_cpu

FORMS = ("npu", "grouped_mm", "cpu", "loop")
_ALIGN_BYTES = 16
_GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}

_forced: Optional[tuple] = None      # (form, npu_ops) while use_form() is active
_form_by_kind: dict = {}


def form_for_kind(kind: str) -> str:
    if kind == "npu":
        return "npu"
    if kind == "cpu":
        return "cpu"
    return "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"


def active_form() -> str:
    """The form in force: the forced one, else the one chosen (once) for the runtime's device."""
    if _forced is not None:
        return _forced[0]
    from .parallel import runtime
    kind = runtime().device.kind
    if kind not in _form_by_kind:
        _form_by_kind[kind] = form_for_kind(kind)
    return _form_by_kind[kind]


@contextlib.contextmanager
def use_form(form: str, npu_ops=None):
    """Force `form` inside the block; `npu_ops` stands in for the torch_npu module (tests)."""
    global _forced
    if form not in FORMS:
        raise ValueError(f"ops form: '{form}' is not one of {', '.join(FORMS)}")
    previous, _forced = _forced, (form, npu_ops)
    try:
        yield
    finally:
        _forced = previous


def _npu():
    if _forced is not None and _forced[1] is not None:
        return _forced[1]
    return importlib.import_module("torch_npu")


def records_no_graph(*tensors) -> bool:
    """True when autograd records nothing for these inputs (None allowed). The kernels that write
    into reused buffers, use out= or call C (moe_cpu.py, the loop's out=) run only then."""
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------- expert MLPs

def routed_experts(x: torch.Tensor, topk_weight: torch.Tensor, topk_idx: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_k topk_weight[t, k] * MLP_{topk_idx[t, k]}(x[t]) for every token t of x [T, H].

    Returned in x's dtype; with `add_to` ([T, H], x's dtype) the sum is added into it in place
    and add_to is returned (the MoE passes its finished shared-MLP output).
    """
    if x.shape[0] == 0:
        return add_to if add_to is not None else x.new_empty(0, w2.shape[-1])
    if active_form() == "cpu" and records_no_graph(x, topk_weight, w13, w2, add_to):
        out = moe_cpu.routed_experts_padded(x, topk_weight, topk_idx, w13, w2, add_to, expert_counts)
        if out is not None:
            return out
    sorted_x, row_idx, counts = permute(x, topk_idx, w13.shape[0])
    routed = unpermute(expert_mlp(sorted_x, w13, w2, counts), row_idx, topk_weight)
    return routed if add_to is None else add_to.add_(routed)


def expert_mlp(sorted_x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (counts [E]) -> down(swiglu(rows @ w13[e])) per group, same row order."""
    if sorted_x.shape[0] == 0:
        return sorted_x.new_empty(0, w2.shape[-1])
    return grouped_matmul(swiglu(grouped_matmul(sorted_x, w13, counts)), w2, counts)


def shared_mlp(x: torch.Tensor, gate_and_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(x1 * silu(x2)) with [x1 | x2] = x @ gate_and_up^T: upstream HunyuanMLP (silu), x [T, H].

    Weights as nn.Linear stores them ([out, in]); the halves are upstream's, NOT swapped (the shared
    MLP keeps upstream's module and weights). Returns a fresh [T, H] tensor.
    """
    if x.shape[0] == 0:
        return x.new_empty(0, down.shape[0])
    if active_form() == "cpu" and records_no_graph(x, gate_and_up, down):
        return moe_cpu.shared_mlp(x, gate_and_up, down)
    x1, x2 = F.linear(x, gate_and_up).chunk(2, dim=-1)
    return F.linear(x1 * F.silu(x2), down)


# ---------------------------------------------------------------- grouped matmul

def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w[e]; x [N, in], w [E, in, out], counts [E] (sum N)."""
    if x.shape[0] == 0:
        return x.new_empty(0, w.shape[-1])
    form = active_form()
    if form == "npu":
        return _grouped_matmul_npu(x, w, counts)
    if form in ("grouped_mm", "cpu") and grouped_mm_applies(x, w):
        return _grouped_matmul_grouped_mm(x, w, counts)
    return grouped_matmul_loop(x, w, counts)


def grouped_matmul_loop(x, w, counts):
    groups, start = [], 0
    for expert, count in enumerate(counts.tolist()):            # the loop form's one host sync
        if count:
            groups.append((expert, start, start + count))
        start += count
    if records_no_graph(x, w):
        out = x.new_empty(x.shape[0], w.shape[-1])
        for expert, start, end in groups:
            torch.matmul(x[start:end], w[expert], out=out[start:end])
        return out
    # Autograd forbids out=; cat keeps the graph (and gives [0, out] for no rows).
    return torch.cat([x[start:end] @ w[expert] for expert, start, end in groups] or [x.new_empty(0, w.shape[-1])])


def grouped_mm_applies(x, w) -> bool:
    if x.dtype != w.dtype or x.dtype not in _GROUPED_MM_DTYPES.get(x.device.type, ()):
        return False
    size = x.element_size()
    return (x.shape[-1] * size) % _ALIGN_BYTES == 0 and (w.shape[-1] * size) % _ALIGN_BYTES == 0


def _grouped_matmul_grouped_mm(x, w, counts):
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offsets)


def _grouped_matmul_npu(x, w, counts):
    if w.shape[0] == 1:
        # One local expert (EP degree == expert count): group_list_type=1 rejects a length-1 list.
        return torch.matmul(x, w[0])
    # group_list_type=1: group_list holds per-group counts; split_item=2: one output tensor.
    return _npu().npu_grouped_matmul([x], [w], group_list=counts.to(torch.int64), group_type=0,
                                     group_list_type=1, split_item=2)[0]


# ---------------------------------------------------------------- routing

def route(logits: torch.Tensor, topk: int, norm_topk_prob: bool, routed_scaling_factor: float):
    """(topk_weight fp32 [T, K], topk_idx [T, K]): upstream topkgating's combine weights, dropless.

    Same operations in the same order as upstream: fp32 softmax over experts, top-k, then either
    normalise by the (eps-clamped) sum of the top-k or multiply by routed_scaling_factor.
    """
    gates = F.softmax(logits.float(), dim=1)
    topk_weight, topk_idx = torch.topk(gates, topk)
    if norm_topk_prob and topk > 1:
        total = topk_weight.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        topk_weight = topk_weight / total
    else:
        topk_weight = topk_weight * routed_scaling_factor
    return topk_weight, topk_idx


def permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
    """Sort the T*K token copies by expert (stable).

    Returns (sorted_x [T*K, H], row_idx [T*K], counts [E] int64) where row_idx[t*K + k] is the
    sorted row holding token t's k-th expert choice.
    """
    if x.shape[0] == 0:
        return (x.new_empty(0, x.shape[1]), topk_idx.new_empty(0, dtype=torch.int64),
                torch.zeros(num_experts, dtype=torch.int64, device=x.device))
    if active_form() == "npu":
        return _permute_npu(x, topk_idx, num_experts)
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_x = x.index_select(0, order // topk_idx.shape[1])     # index_select: ~6x faster than x[idx] on CPU
    row_idx = torch.empty_like(order)
    row_idx[order] = torch.arange(order.numel(), device=order.device)
    return sorted_x, row_idx, expert_counts(flat, num_experts)


def expert_counts(flat_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    # scatter_add, not bincount: bincount syncs with the host on accelerators to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_idx.device)
    return counts.scatter_add_(0, flat_idx.long(), torch.ones_like(flat_idx, dtype=torch.int64))


def _permute_npu(x, topk_idx, num_experts):
    rows = topk_idx.numel()
    sorted_x, row_idx, counts, _ = _npu().npu_moe_init_routing_v2(
        x, topk_idx.to(torch.int32), active_num=rows, expert_num=num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
        quant_mode=-1, row_idx_type=0)
    return sorted_x, row_idx, counts.to(torch.int64)


def unpermute(y: torch.Tensor, row_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k topk_weight[t, k] * y[row_idx[t*K + k]], in y's dtype."""
    if topk_weight.shape[0] == 0:
        return y.new_empty(0, y.shape[-1])
    if active_form() == "npu":
        return _unpermute_npu(y, row_idx, topk_weight)
    tokens, topk = topk_weight.shape
    rows = y.index_select(0, row_idx.long()).view(tokens, topk, y.shape[-1])
    # In y's dtype, like upstream's combine einsum (combine_weights.type_as(hidden_states)).
    return torch.bmm(topk_weight.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def _unpermute_npu(y, row_idx, topk_weight):
    # drop_pad_mode=2: dropless, expanded_src_to_dst_row indexed token-major (t*K + k), matching
    # init_routing_v2's row_idx_type=0 output.
    return _npu().npu_moe_finalize_routing(y, None, None, None, topk_weight.to(y.dtype), row_idx.to(torch.int32),
                                           None, drop_pad_mode=2)


# ---------------------------------------------------------------- EP regrouping

def regroup(x: torch.Tensor, counts_per_rank: torch.Tensor):
    """Rows arrive grouped (source rank, local expert); return them grouped by local expert.

    counts_per_rank [R, E_local]. Returns (grouped_x, order, local_counts [E_local] int64) with
    grouped_x = x[order].
    """
    if x.shape[0] == 0:
        return x, torch.zeros(0, dtype=torch.int64, device=x.device), counts_per_rank.sum(0).to(torch.int64)
    if active_form() == "npu" and x.dtype in (torch.float16, torch.bfloat16):
        grouped, _, order, local_counts = _npu().npu_moe_re_routing(
            x, counts_per_rank, expert_token_num_type=1, idx_type=0)
        return grouped, order, local_counts.to(torch.int64)
    local_experts = counts_per_rank.shape[1]
    expert_of_slot = torch.arange(counts_per_rank.numel(), device=x.device) % local_experts
    expert_of_row = torch.repeat_interleave(expert_of_slot, counts_per_rank.reshape(-1), output_size=x.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    return x[order], order, counts_per_rank.sum(0).to(torch.int64)


def ungroup(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(y)
    out[order.long()] = y
    return out


# ---------------------------------------------------------------- activation

def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half (npu_swiglu's convention; see the module docstring)."""
    if x.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    if active_form() == "npu":
        return _npu().npu_swiglu(x, dim=-1)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# ---------------------------------------------------------------- attention

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
              scale: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale [masked]) v per head, GQA-aware.

    q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq % Hkv == 0 (query head h reads KV head h // (Hq/Hkv)).
    mask: None, bool [B|1, 1, Sq, Sk] with True = attend (SDPA's and upstream's convention), or an
    additive float mask (0 / large negative). scale: None = 1/sqrt(D). Returns [B, Hq, Sq, D].
    The torch form is upstream's repeat_kv + SDPA; the NPU form is npu_fused_infer_attention_score.
    """
    if active_form() == "npu":
        return _attention_npu(q, k, v, mask, scale)
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    if q.device.type == "cuda" and mask is not None:
        # upstream's workaround: the memory-efficient SDPA backend mishandles strided inputs with a mask
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv*groups, S, D], each KV head repeated for its query heads (upstream's repeat_kv)."""
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)


def _attention_npu(q, k, v, mask, scale):
    # The fused op masks where atten_mask is True (the opposite of SDPA) and takes KV heads unrepeated.
    masked = None
    if mask is not None:
        masked = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
    out, _ = _npu().npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=masked, num_heads=q.shape[1],
        num_key_value_heads=k.shape[1], input_layout="BNSD", scale=scale or q.shape[-1] ** -0.5, sparse_mode=0)
    return out
