"""The Ascend kernel set: torch_npu's fused ops where one exists, the torch set's steps elsewhere.

    grouped_matmul   torch_npu.npu_grouped_matmul (group_list_type=1: per-group counts)
    expert weights   npu_format_cast(w, 29): stored in the FRACTAL_NZ format the cube unit reads
                     (same values; done once after loading, as the cann-recipes recipe does)
    permute          npu_moe_init_routing_v2 (dropless, token-major row index)
    unpermute        npu_moe_finalize_routing (drop_pad_mode=2)
    regroup          npu_moe_re_routing (fp16/bf16 rows)
    swiglu           npu_swiglu (silu of the first half)
    attention        npu_fused_infer_attention_score (BNSD, mask inverted: the op masks where True)

Considered and not adopted (issue 13): fusing the shared-MLP add into finalize_routing (skip1)
rounds once where upstream rounds twice (routed sum, then + shared), so it is not the same math,
and saves one [T, H] elementwise pass per layer (~0.5 % of a step by bandwidth); splitting the
attention into a causal text part (sparse_mode) and an unmasked image part is the same math but
needs the mask's structure recognised per forward, and its gain has to be measured on an NPU first.

Written from the torch_npu 2.13 schemas and the Ascend docs (../shared/reference); NOT run on
Ascend hardware in this project. Tested on CPU against tests/npu_double.py, a test double that
implements the documented semantics and rejects what the docs reject. `NpuKernels(npu=double)`
runs these call sites against it; production passes nothing and torch_npu is imported here.
"""
from __future__ import annotations

import importlib

import torch

from .torch_kernels import LoopKernels


ACL_FORMAT_FRACTAL_NZ = 29


class NpuKernels(LoopKernels):
    name = "npu"

    def __init__(self, npu=None):
        self.npu = npu if npu is not None else importlib.import_module("torch_npu")
        self._mask_in, self._mask_out = None, None      # (mask, its version), inverted: _masked_positions

    def expert_weight_storage(self, w):
        return self.npu.npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ)

    def grouped_matmul(self, x, w, counts):
        if x.shape[0] == 0:
            return x.new_empty(0, w.shape[-1])
        if w.shape[0] == 1:
            # One local expert (EP degree == expert count): group_list_type=1 rejects a length-1 list.
            return torch.matmul(x, w[0])
        # group_list_type=1: group_list holds per-group counts; split_item=2: one output tensor.
        return self.npu.npu_grouped_matmul([x], [w], group_list=counts.to(torch.int64), group_type=0,
                                           group_list_type=1, split_item=2)[0]

    def permute(self, x, topk_idx, num_experts):
        if x.shape[0] == 0:
            return super().permute(x, topk_idx, num_experts)
        rows = topk_idx.numel()
        sorted_x, row_idx, counts, _ = self.npu.npu_moe_init_routing_v2(
            x, topk_idx.to(torch.int32), active_num=rows, expert_num=num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
            quant_mode=-1, row_idx_type=0)
        return sorted_x, row_idx, counts.to(torch.int64)

    def unpermute(self, y, row_idx, topk_weight):
        if topk_weight.shape[0] == 0:
            return y.new_empty(0, y.shape[-1])
        # drop_pad_mode=2: dropless, expanded_src_to_dst_row indexed token-major (t*K + k), matching
        # init_routing_v2's row_idx_type=0 output.
        return self.npu.npu_moe_finalize_routing(y, None, None, None, topk_weight.to(y.dtype),
                                                 row_idx.to(torch.int32), None, drop_pad_mode=2)

    def regroup(self, x, counts_per_rank):
        if x.shape[0] == 0 or x.dtype not in (torch.float16, torch.bfloat16):
            return super().regroup(x, counts_per_rank)
        grouped, _, order, local_counts = self.npu.npu_moe_re_routing(
            x, counts_per_rank, expert_token_num_type=1, idx_type=0)
        return grouped, order, local_counts.to(torch.int64)

    def swiglu(self, x):
        if x.shape[0] == 0:
            return super().swiglu(x)
        return self.npu.npu_swiglu(x, dim=-1)

    def _masked_positions(self, mask):
        """The fused op masks where atten_mask is True (the opposite of SDPA). Every layer of one
        forward gets the same mask tensor: it is inverted once (a B x S x S pass) and reused by the
        other layers, instead of once per layer."""
        if mask is None:
            return None
        if self._mask_in is None or self._mask_in[0] is not mask or self._mask_in[1] != mask._version:
            inverted = ~mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min / 2
            self._mask_in, self._mask_out = (mask, mask._version), inverted     # _version: written in place since
        return self._mask_out

    def attention(self, q, k, v, mask=None, scale=None):
        # The fused op takes KV heads unrepeated.
        masked = self._masked_positions(mask)
        out, _ = self.npu.npu_fused_infer_attention_score(
            q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=masked, num_heads=q.shape[1],
            num_key_value_heads=k.shape[1], input_layout="BNSD", scale=scale or q.shape[-1] ** -0.5, sparse_mode=0)
        return out
