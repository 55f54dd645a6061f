"""TEST DOUBLE of the torch_npu ops that adaptor_patches/kernels/npu.py calls -- plain torch, tests only.

Each function implements the op's documented semantics (Ascend Extension for PyTorch docs and
the torch_npu 2.13 schemas, see ../shared/reference/npu_ops.md) and checks the documented
argument constraints the NPU kernel set relies on (dtypes, modes), so a wrong call in the NPU form fails on
CPU. It is written independently of the torch kernel sets so the two can be compared. Where the
docs were ambiguous the chosen reading is stated; none of it was checked on Ascend hardware.

    make_kernels("npu", npu=npu_double)      # adaptor_patches.kernels
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

IS_TEST_DOUBLE = True


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"npu_double: {message}")


def _require_rows(t, name: str) -> None:
    # npu_swiglu documents empty tensors as unsupported; grouped matmul and the routing ops leave
    # them undocumented. Read strictly: none of them is called with zero rows.
    _require(t.numel() > 0, f"{name} is empty (empty tensors are unsupported)")


ACL_FORMATS = {2: "ND", 29: "FRACTAL_NZ"}
format_casts: list = []          # (shape, acl_format) of every npu_format_cast call, for tests to inspect


def npu_format_cast(tensor, acl_format, *, customize_dtype=None, input_dtype=None):
    """A storage-format change: the values (and what every op computes from them) stay the same; the
    double returns the same values and records the call (the fractal layout itself is not modelled)."""
    _require(acl_format in ACL_FORMATS, f"acl_format {acl_format} is not one of {ACL_FORMATS}")
    _require(customize_dtype is None and input_dtype is None, "dtype customisation is not modelled")
    _require(tensor.dim() >= 2, "NZ needs at least a 2-D tensor")
    format_casts.append((tuple(tensor.shape), acl_format))
    return tensor.clone()


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, group_type=None,
                       group_list_type=0, split_item=0, output_dtype=None, **unsupported):
    """One matmul per contiguous row group of x[0] against weight[0][g] ([G, in, out]).

    Modelled forms (docs table "group_list为Tensor", Atlas A2/A3; single x / weight / y tensor):
      plain      x fp16/bf16/fp32, weight the same dtype: y = x @ w
      W8A16      ("伪量化") x fp16/bf16, weight int8, antiquant_scale [G, N] in x's dtype, optional
                 antiquant_offset of the same shape and dtype: y = x @ ((w + offset) * antiquant_scale)
      W8A8       (pertoken) x int8, weight int8, scale [G, N] bf16 with output_dtype bf16 (or fp32 with
                 fp16), per_token_scale fp32 [M]: y = (x @ w) * scale * per_token_scale, the product
                 accumulated exactly (int32 on the device; float64 here)
      W4A16      ("伪量化", int4 weight carried in int32): x fp16/bf16, weight int32 [G, K, N/8] (8 int4
                 per int32, as npu_convert_weight_to_int4pack packs them; op-plugin's wrapper makes the
                 output N = 8 x the weight's last dim), antiquant_scale in x's dtype, [G, N]
                 (perchannel) or [G, Gk, N] (pergroup, Gk dividing K: group k // (K / Gk)), optional
                 antiquant_offset of that shape: y = x @ ((w + offset) * antiquant_scale); N even
    The docs say "1-D" for scale tensors; for one weight tensor of G groups the reading taken is
    [G, N] (the antiquant_scale rule stated for that case). int8 weights in the W8A16 form are
    per-channel only (no per-group); float8 weights are not in the table and are rejected.
    """
    _require(len(x) == 1 and len(weight) == 1, "only the single-tensor x / weight form is modelled")
    _require(group_type == 0, "group_type must be 0 (groups split the rows, M axis)")
    _require(split_item in (2, 3), "split_item 2/3 (one output tensor) is the modelled form")
    _require(bias is None and offset is None and not any(v is not None for v in unsupported.values()),
             "bias / offset / activation options are not modelled")
    _require(group_list is not None and group_list.dtype == torch.int64, "group_list must be int64")
    rows, w = x[0], weight[0]
    _require_rows(rows, "x")
    _require(w.dim() == 3 and w.shape[1] == rows.shape[1], "weight must be [G, in, out] matching x")
    groups, n = w.shape[0], w.shape[2] * (INT4_PER_INT32 if w.dtype == torch.int32 else 1)
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _require(group_list_type in (0, 1), "group_list_type 0 (cumsum) or 1 (counts) is the modelled form")
    _require(group_list_type != 0 or bool((counts >= 0).all()), "group_list (cumsum) must be non-decreasing")
    counts = counts.tolist()
    _require(group_list_type != 1 or len(counts) > 1, "group_list of length 1 is unsupported with group_list_type=1")
    _require(len(counts) == groups, "group_list must have one entry per weight group")
    # Read strictly: the groups cover x exactly (the docs give no meaning to rows outside every group).
    _require(sum(counts) == rows.shape[0], f"group_list sums to {sum(counts)}, x has {rows.shape[0]} rows")

    def one(name, value):
        _require(value is None or (isinstance(value, (list, tuple)) and len(value) == 1),
                 f"{name} must be a list of one tensor (one weight tensor)")
        return None if value is None else value[0]
    scale, antiquant_scale, antiquant_offset, per_token_scale = (
        one("scale", scale), one("antiquant_scale", antiquant_scale), one("antiquant_offset", antiquant_offset),
        one("per_token_scale", per_token_scale))
    if w.dtype == torch.int32:                                                           # W4A16
        return [_int4_weight_only(rows, w, counts, antiquant_scale, antiquant_offset, scale, per_token_scale,
                                  output_dtype)]
    if w.dtype == torch.int8 and rows.dtype in (torch.float16, torch.bfloat16):          # W8A16
        _require(scale is None and per_token_scale is None, "W8A16 takes antiquant_scale, not scale/per_token_scale")
        _require(antiquant_scale is not None, "int8 weight with a float x needs antiquant_scale")
        _require(antiquant_scale.dtype == rows.dtype, f"antiquant_scale must be {rows.dtype} (x's dtype), "
                                                      f"got {antiquant_scale.dtype}")
        _require(tuple(antiquant_scale.shape) == (groups, n), f"antiquant_scale must be [g, n] = {[groups, n]} "
                                                              f"(per channel), got {list(antiquant_scale.shape)}")
        if antiquant_offset is not None:
            _require(antiquant_offset.dtype == antiquant_scale.dtype and
                     antiquant_offset.shape == antiquant_scale.shape, "antiquant_offset must match antiquant_scale")
        _require(output_dtype in (None, rows.dtype), f"W8A16 output_dtype must be None or {rows.dtype}")
        offset_w = 0.0 if antiquant_offset is None else antiquant_offset.float().unsqueeze(1)
        w_real = (w.float() + offset_w) * antiquant_scale.float().unsqueeze(1)
        return [_per_group(rows.float(), w_real, counts).to(rows.dtype)]
    if w.dtype == torch.int8 and rows.dtype == torch.int8:                               # W8A8 per token
        _require(antiquant_scale is None and antiquant_offset is None, "int8 x takes scale, not antiquant_scale")
        _require(scale is not None and per_token_scale is not None,
                 "the modelled int8 x int8 form is per token: scale and per_token_scale")
        allowed = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
        _require(scale.dtype in allowed, f"scale must be bf16 or fp32, got {scale.dtype}")
        _require(output_dtype == allowed[scale.dtype],
                 f"scale {scale.dtype} goes with output_dtype {allowed[scale.dtype]}, got {output_dtype}")
        _require(tuple(scale.shape) == (groups, n), f"scale must be [g, n] = {[groups, n]}, got {list(scale.shape)}")
        _require(per_token_scale.dtype == torch.float32 and tuple(per_token_scale.shape) == (rows.shape[0],),
                 f"per_token_scale must be fp32 [m] = [{rows.shape[0]}], got {per_token_scale.dtype} "
                 f"{list(per_token_scale.shape)}")
        acc = _per_group(rows.double(), w.double(), counts)
        acc = acc * per_token_scale.double().unsqueeze(1)
        bounds = _bounds(counts)
        for g in range(groups):
            acc[bounds[g]:bounds[g + 1]] *= scale[g].double()
        return [acc.to(output_dtype)]
    _require(w.dtype == rows.dtype and rows.dtype in (torch.float16, torch.bfloat16, torch.float32),
             f"x {rows.dtype} with weight {w.dtype} is not a documented combination")
    _require(scale is None and antiquant_scale is None and per_token_scale is None and antiquant_offset is None,
             "a float weight takes no quantization scales")
    _require(output_dtype in (None, rows.dtype), "output_dtype must be None or x's dtype")
    return [_per_group(rows.float(), w.float(), counts).to(rows.dtype)]


INT4_PER_INT32 = 8


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 [k, n] (2-D, contiguous, n a multiple of 8, every value in [-8, 7]) -> int32 [k, n/8]:
    eight int4 per int32, element 8j + i of a row in bits 4i .. 4i + 3 (its two's complement nibble),
    as op-plugin's convert_to_int4_pack writes them (ConvertWeightToINT4PackKernelNpuOpApi.cpp, the
    ND path of Atlas A2/A3). inner_k_tiles: a reserved parameter (docs), ignored."""
    _require(weight.dtype == torch.int32, f"weight must be int32, got {weight.dtype}")
    _require(weight.dim() == 2, f"weight must be 2-D (k, n) or (n, k), got {weight.dim()}-D")
    _require(weight.is_contiguous(), "weight must be contiguous")
    _require(weight.shape[-1] % INT4_PER_INT32 == 0, f"the last dim ({weight.shape[-1]}) must be 8-aligned")
    _require(bool(((weight >= -8) & (weight <= 7)).all()), "weight values must be in the int4 range [-8, 7]")
    nibbles = (weight.to(torch.int64) & 0xF).view(weight.shape[0], -1, INT4_PER_INT32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=weight.device)
    packed = (nibbles << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_int4(packed):
    """npu_convert_weight_to_int4pack's inverse on the last dim: int32 [..., n/8] -> float32 [..., n]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return ((nibbles ^ 8) - 8).flatten(-2).float()


def _int4_weight_only(rows, w, counts, antiquant_scale, antiquant_offset, scale, per_token_scale, output_dtype):
    _require(rows.dtype in (torch.float16, torch.bfloat16), f"an int4 weight takes fp16/bf16 x, got {rows.dtype}")
    _require(scale is None and per_token_scale is None, "W4A16 takes antiquant_scale, not scale/per_token_scale")
    _require(antiquant_scale is not None, "an int4 weight with a float x needs antiquant_scale")
    _require(antiquant_scale.dtype == rows.dtype, f"antiquant_scale must be {rows.dtype} (x's dtype), "
                                                  f"got {antiquant_scale.dtype}")
    groups, k, n = w.shape[0], w.shape[1], w.shape[2] * INT4_PER_INT32
    _require(n % 2 == 0, "an int4 weight's N must be even")
    shape = tuple(antiquant_scale.shape)
    _require(shape == (groups, n) or (len(shape) == 3 and shape[0] == groups and shape[2] == n and shape[1] > 0
                                      and k % shape[1] == 0),
             f"antiquant_scale must be [g, n] = {[groups, n]} (perchannel) or [g, G, n] with G dividing k = {k} "
             f"(pergroup), got {list(shape)}")
    if antiquant_offset is not None:
        _require(antiquant_offset.dtype == antiquant_scale.dtype and antiquant_offset.shape == antiquant_scale.shape,
                 "antiquant_offset must match antiquant_scale")
    _require(output_dtype in (None, rows.dtype), f"W4A16 output_dtype must be None or {rows.dtype}")

    def per_row(t):                           # [g, n] or [g, G, n] -> [g, k, n]
        t = t.float()
        return t.unsqueeze(1) if t.dim() == 2 else t.repeat_interleave(k // t.shape[1], dim=1)
    offset_w = 0.0 if antiquant_offset is None else per_row(antiquant_offset)
    w_real = (_unpack_int4(w) + offset_w) * per_row(antiquant_scale)
    return _per_group(rows.float(), w_real, counts).to(rows.dtype)


def _bounds(counts):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def _per_group(rows, w, counts):
    out = rows.new_zeros(rows.shape[0], w.shape[2])
    bounds = _bounds(counts)
    for g in range(len(counts)):
        lo, hi = bounds[g], bounds[g + 1]
        out[lo:hi] = rows[lo:hi] @ w[g]
    return out


def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                      dst_type_max=0.0):
    """Symmetric per-token int8 quantization: scale = rowMax(|x|) / 127 (fp32, x.shape[:-1]),
    y = round(x / scale) as int8. x fp16/bf16 with more than one dim; dst_type None (= int8).
    Not modelled: smooth_scales / group_index (SmoothQuant), int4. A row of zeros has scale 0 in
    the formula; here its y is 0 (the device's value for 0/0 is not documented)."""
    _require(x.dtype in (torch.float16, torch.bfloat16), f"x must be fp16/bf16, got {x.dtype}")
    _require(x.dim() > 1, "x must have more than one dimension")
    _require_rows(x, "x")
    _require(smooth_scales is None and group_index is None, "smooth_scales / group_index are not modelled")
    _require(dst_type in (None, torch.int8), "only int8 output (dst_type None / torch.int8) is modelled")
    _require(quant_mode == "pertoken", "only quant_mode 'pertoken' is modelled")
    x32 = x.float()
    scale = x32.abs().amax(dim=-1) / 127.0
    y = torch.where(scale.unsqueeze(-1) > 0, x32 / scale.unsqueeze(-1), torch.zeros_like(x32))
    return y.round().clamp(-127, 127).to(torch.int8), scale


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                            expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(),
                            row_idx_type=0, x_dtype=None):
    """Sort the (token, k) pairs by expert id, stably.

    expanded_x[i] = x[sorted_slot[i] // K]; expanded_row_idx[slot] = i (row_idx_type 0, read as the
    token-major slot -> expanded-row map that finalize_routing's drop_pad_mode 2 consumes);
    counts per expert (type 1) or their cumsum (type 0).
    quant_mode -1: unquantised, the 4th output empty. quant_mode 1 (dynamic quant, no smooth
    `scale`): each expanded row quantized to int8 on its own, expanded_scale[i] = max|row| / 127
    (float32, [NUM_ROWS * K]) and expanded_x[i] = round(row / expanded_scale[i]) (the docs' formula
    and op-plugin's golden for the routing ops' dynamic quant; a zero row: 0 here, undocumented there).
    """
    _require(expert_idx.dtype == torch.int32 and expert_idx.dim() == 2, "expert_idx must be 2-D int32")
    _require(x.dim() == 2 and x.shape[0] == expert_idx.shape[0], "x must be [NUM_ROWS, H]")
    _require_rows(x, "x")
    _require(drop_pad_mode == 0 and quant_mode in (-1, 1) and scale is None and offset is None,
             "only dropless, unquantised or dynamically quantised without smooth scales is modelled")
    _require(quant_mode == -1 or x.dtype in (torch.float16, torch.bfloat16, torch.float32),
             "dynamic quant takes fp16 / bf16 / fp32 x")
    _require(active_num == expert_idx.numel(), "active_num must equal NUM_ROWS * K")
    # expert_tokens_num_type: 0 (cumsum) is documented as unsupported; 1 (counts) is what we use, 2
    # (key-value pairs) is not modelled.
    _require(expert_tokens_num_flag and expert_tokens_num_type == 1, "counts must be requested with type 1")
    _require(list(active_expert_range) == [0, expert_num], "active_expert_range must cover all experts")
    _require(row_idx_type == 0, "row_idx_type 0 is the modelled index type")
    topk = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).long()
    sorted_slot = torch.sort(flat, stable=True).indices
    expanded_x = x[sorted_slot // topk]
    expanded_row_idx = torch.zeros_like(sorted_slot, dtype=torch.int32)
    expanded_row_idx[sorted_slot] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
    if quant_mode == 1:
        rows = expanded_x.float()
        expanded_scale = rows.abs().amax(dim=-1) / 127.0
        safe = torch.where(expanded_scale > 0, expanded_scale, torch.ones_like(expanded_scale))
        expanded_x = (rows / safe.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return expanded_x, expanded_row_idx, counts, expanded_scale
    return expanded_x, expanded_row_idx, counts, torch.empty(0, dtype=torch.float32, device=x.device)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """out[i] = skip1 + skip2 + sum_k scales[i,k] * (rows[src_to_dst[pos(i,k)]] + bias[expert(i,k)]).

    pos(i,k) = i + k*NUM_ROWS for drop_pad_mode 0 (column order), i*K + k for mode 2 (row order).
    """
    _require(drop_pad_mode in (0, 2), "only the dropless modes 0 and 2 are modelled")
    _require(scales is not None and scales.dtype == expanded_permuted_rows.dtype,
             "scales must have the dtype of expanded_permuted_rows")
    _require(expanded_src_to_dst_row.dtype == torch.int32, "expanded_src_to_dst_row must be int32")
    _require_rows(expanded_permuted_rows, "expanded_permuted_rows")
    rows_n, topk = scales.shape
    index = expanded_src_to_dst_row.long()
    index = index.view(rows_n, topk) if drop_pad_mode == 2 else index.view(topk, rows_n).t()
    picked = expanded_permuted_rows[index].float()                       # [NUM_ROWS, K, H]
    if bias is not None:
        picked = picked + bias[export_for_source_row.long()].float()
    out = (picked * scales.float().unsqueeze(-1)).sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(expanded_permuted_rows.dtype)


def npu_moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1,
                       idx_type=0):
    """Regroup rows laid out (rank, expert) into expert-major order; permute_token_idx is a gather index."""
    _require(tokens.dtype in (torch.float16, torch.bfloat16, torch.int8), "tokens must be fp16/bf16/int8")
    _require(expert_token_num_per_rank.dim() == 2, "expert_token_num_per_rank must be [N ranks, E]")
    _require_rows(tokens, "tokens")
    _require(expert_token_num_type == 1 and idx_type == 0, "only count mode and gather indices are modelled")
    counts = expert_token_num_per_rank.long()
    _require(int(counts.sum()) == tokens.shape[0], "sum of counts must equal the token rows")
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    starts = starts.view_as(counts)
    pieces = [torch.arange(int(starts[r, e]), int(starts[r, e] + counts[r, e]), device=tokens.device)
              for e in range(counts.shape[1]) for r in range(counts.shape[0])]
    gather = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=tokens.device)
    scales = per_token_scales[gather] if per_token_scales is not None else torch.empty(0, device=tokens.device)
    return tokens[gather], scales, gather.to(torch.int32), counts.sum(0).to(expert_token_num_per_rank.dtype)


def npu_swiglu(x, dim=-1):
    """silu(first half) * second half along `dim`."""
    _require_rows(x, "x")
    first, second = x.chunk(2, dim=dim)
    return (F.silu(first.float()) * second.float()).to(x.dtype)


def npu_fused_infer_attention_score(query, key, value, *, atten_mask=None, num_heads=1, scale=1.0,
                                    input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                    pre_tokens=2147483647, next_tokens=2147483647, softmax_lse_flag=False,
                                    **unsupported):
    """softmax(Q K^T * scale, masked) V with native GQA; returns (attention_out, softmax_lse).

    Modelled: input_layout "BNSD", sparse_mode 0 (atten_mask used as given), atten_mask bool with
    True = position does NOT take part (the opposite of SDPA's bool mask), shaped [B|1, 1, Sq, Skv]
    or [Sq, Skv]; query head h reads KV head h // (num_heads / num_key_value_heads); 0 KV heads
    means num_heads. Query/key/value fp16 or bf16 and contiguous, as documented. A fully masked
    row comes out as zeros here; on hardware its value is unspecified.
    """
    _require(input_layout == "BNSD", "only input_layout BNSD is modelled")
    _require(sparse_mode == 0, "only sparse_mode 0 (mask used as given) is modelled")
    _require(not any(v is not None for v in unsupported.values()), "quant/pse/paged options are not modelled")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _require(t.dtype in (torch.float16, torch.bfloat16), f"{name} must be fp16/bf16, got {t.dtype}")
        _require(t.is_contiguous(), f"{name} must be contiguous")
    kv_heads = num_key_value_heads or num_heads
    _require(query.shape[1] == num_heads and key.shape[1] == kv_heads == value.shape[1],
             "num_heads / num_key_value_heads must match the N axis of query / key, value")
    _require(num_heads % kv_heads == 0, "num_heads must be a multiple of num_key_value_heads")
    groups = num_heads // kv_heads
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if atten_mask is not None:
        _require(atten_mask.dtype == torch.bool, "atten_mask must be bool (True = masked out)")
        _require(atten_mask.dim() in (2, 4), "atten_mask must be [Sq, Skv] or [B|1, 1, Sq, Skv]")
        scores = scores.masked_fill(atten_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True) if softmax_lse_flag else torch.empty(0, device=query.device)
    return torch.matmul(probs, v).to(query.dtype), lse


# ---------------------------------------------------------------- communication fused with matmuls

class npu:                                       # the torch_npu.npu functions the kernel set reads
    device_name = "Ascend910_9392"               # an A3 name; tests set an A2 one ("Ascend910B3")

    @classmethod
    def get_device_name(cls, device=None):
        return cls.device_name


_communicators: dict = {}                        # HCCL communicator name -> process group (gloo here)
fused_calls: list = []                           # the fused ops' names, in call order, for tests to inspect
FUSED_WORLD_SIZES = {"A2": (2, 4, 8), "A3": (2, 4, 8, 16, 32)}


def hccl_comm_name(group) -> str:
    """Stands in for ProcessGroupHCCL.get_hccl_comm_name(rank): a name the fused ops resolve to the group."""
    import torch.distributed as dist
    name = "hcom_double_" + "_".join(map(str, dist.get_process_group_ranks(group)))
    _communicators[name] = group
    return name


def _fused_common(x1, x2, hcom, world_size, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode):
    """The constraints both fused ops document (op-plugin docs, torch_npu 2.13 schemas)."""
    import torch.distributed as dist
    _require(hcom in _communicators, f"hcom {hcom!r} is not a communicator name from get_hccl_comm_name")
    group = _communicators[hcom]
    soc = "A2" if "Ascend910B" in npu.device_name else "A3"
    _require(world_size == dist.get_world_size(group), f"world_size {world_size} is not the communicator's size "
                                                       f"{dist.get_world_size(group)}")
    _require(world_size in FUSED_WORLD_SIZES[soc], f"world_size {world_size}: {soc} supports {FUSED_WORLD_SIZES[soc]}")
    _require(x1.dim() == 2 and x2.dim() == 2, "x1 and x2 must be 2-D, (m, k) and (k, n)")
    _require(x1.dtype in (torch.float16, torch.bfloat16) and x2.dtype == x1.dtype,
             f"x1 / x2 must be fp16 or bf16 of one dtype (int8 needs the quantized form, not modelled), "
             f"got {x1.dtype} / {x2.dtype}")
    _require(x1.shape[1] == x2.shape[0], f"k axes differ: x1 {list(x1.shape)}, x2 {list(x2.shape)}")
    _require(256 <= x1.shape[1] < 65535, f"k = {x1.shape[1]} is outside [256, 65535)")
    _require(x1.is_contiguous(), "x1 must not be a transposed (non-contiguous) tensor; only x2 may be")
    _require(bias is None or not bool(bias.any()), "bias must be None (non-zero bias is unsupported)")
    _require(x1_scale is None and x2_scale is None and output_dtype is None, "the quantized form is not modelled")
    _require(comm_turn == 0, f"comm_turn {comm_turn}: only 0 is supported")
    _require(comm_mode in (None, "ai_cpu", "aiv"), f"comm_mode {comm_mode!r} is not ai_cpu or aiv")
    return group


def npu_all_gather_base_mm(x1, x2, hcom, world_size, *, bias=None, x1_scale=None, x2_scale=None, gather_index=0,
                           gather_output=True, comm_turn=0, output_dtype=None, comm_mode=None):
    """(allgather(x1) @ x2, allgather(x1) or an empty tensor): x1 (m, k) gathered in rank order."""
    import torch.distributed as dist
    group = _fused_common(x1, x2, hcom, world_size, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    _require(gather_index == 0, f"gather_index {gather_index}: only 0 (gather x1) is supported")
    fused_calls.append("npu_all_gather_base_mm")
    gathered = x1.new_empty(world_size * x1.shape[0], x1.shape[1])
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, x1, group=group)
    out = (gathered.float() @ x2.float()).to(x1.dtype)
    return out, gathered if gather_output else x1.new_empty(0)


def npu_mm_reduce_scatter_base(input, x2, hcom, world_size, *, reduce_op="sum", bias=None, x1_scale=None,
                               x2_scale=None, comm_turn=0, output_dtype=None, comm_mode=None):
    """reducescatter(input @ x2): every rank's (m, n) product summed, rank r keeping rows
    [r*m/world_size, (r+1)*m/world_size)."""
    import torch.distributed as dist
    group = _fused_common(input, x2, hcom, world_size, bias, x1_scale, x2_scale, comm_turn, output_dtype, comm_mode)
    _require(reduce_op == "sum", f"reduce_op {reduce_op!r}: only 'sum' is supported")
    _require(input.shape[0] % world_size == 0, f"m = {input.shape[0]} must divide by world_size {world_size}")
    fused_calls.append("npu_mm_reduce_scatter_base")
    product = (input.float() @ x2.float()).to(input.dtype)
    out = product.new_empty(input.shape[0] // world_size, x2.shape[1])
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, product, group=group)
    return out


def w8a8_experts():
    """(kernel set, expert format): the NPU kernel set through this double computing W8A8, int8 experts
    (harness/comm_counts.py's W8A8 layouts: the EP rows cross ranks as int8)."""
    from adaptor_patches.kernels.npu import NpuKernels
    return NpuKernels(npu=sys.modules[__name__], quant_compute="w8a8", comm_name=hccl_comm_name), "int8"
