"""The Ascend kernel set: torch_npu's fused ops where one exists, the torch set's steps elsewhere.

    grouped_matmul   torch_npu.npu_grouped_matmul (group_list_type=1: per-group counts)
    expert weights   npu_format_cast(w, 29): stored in the FRACTAL_NZ format the cube unit reads
                     (same values; done once after loading, as the cann-recipes recipe does)
    permute          npu_moe_init_routing_v2 (dropless, token-major row index)
    unpermute        npu_moe_finalize_routing (drop_pad_mode=2)
    regroup          npu_moe_re_routing (fp16/bf16 rows)
    swiglu           npu_swiglu (silu of the first half)
    attention        npu_fused_infer_attention_score (BNSD, mask inverted: the op masks where True)
    8-bit experts    quantized_grouped_matmul, int8 weights only (the op takes no float8 weight):
                     w8a16: npu_grouped_matmul, int8 `weight` + bf16 `antiquant_scale` [E, N]
                     w8a8: npu_dynamic_quant per token, then npu_grouped_matmul int8 x int8
                     with bf16 `scale` [E, N], fp32 `per_token_scale` [M], output_dtype bf16
    int4 experts     w4a16 ("伪量化" pergroup): npu_grouped_matmul with the int4 weight carried in
                     int32 [E, K, N/8] (npu_convert_weight_to_int4pack of the int32 values, one
                     expert at a time after loading; ND, not NZ) and bf16 `antiquant_scale`
                     [E, K/G, N] ("[g, G, n]", G dividing K), no antiquant_offset (symmetric):
                     y = x @ (w * antiquant_scale). Docs (npu_grouped_matmul, group_list a
                     Tensor, Atlas A2/A3): x bf16 with an int4 weight takes a bf16 antiquant_scale
                     and gives bf16; N even. op-plugin's wrapper reads an int32 weight as int4,
                     8 to an int32 (its output N is 8 x the weight's last dim).
    int8 dispatch    (w8a8 with int8 experts: quant.DISPATCH_FORMATS) the EP rows cross ranks as int8:
                     permute_quantized = npu_moe_init_routing_v2 quant_mode=1 (dynamic per-row int8,
                     its 4th output the float32 scales), regroup_quantized = npu_moe_re_routing with
                     per_token_scales, quantized_rows_matmul = the w8a8 grouped matmul on the int8
                     rows and their scales as they arrive (no npu_dynamic_quant: the same numbers)
    all_gather_matmul      npu_all_gather_base_mm (A2 and A3), as the recipe calls it before qkv_proj
    matmul_reduce_scatter  A3: npu_mm_reduce_scatter_base; A2 ("Ascend910B" in the device name): a
                     plain matmul + reduce-scatter, the recipe's own split (its o_proj path)
                     Both (docs, torch_npu / op-plugin 7.x): x fp16/bf16 2-D (m, k) and not
                     transposed, x2 = weight.t() (k, n) may be, k in [256, 65535), world_size 2/4/8
                     on A2 and 2/4/8/16/32 on A3, gather_index 0, comm_turn 0, no bias; the
                     reduce-scatter's m divisible by world_size (the padded shares make it so).
                     Outside those, the plain form (collective_matmul.py) runs; every rank decides
                     alike (same dtype, shapes, group size, device model). The HCCL group name:
                     `group._get_backend(torch.device("npu")).get_hccl_comm_name(global rank)`
                     (docs: the current device must be set; the rank is the global rank). On A2 the
                     docs allow the fused ops of one model a single communicator (ai_cpu mode): the
                     attention's are all on the branch's group. comm_mode is left at its default,
                     as the recipe leaves it (its docs call ai_cpu a training mode and aiv both;
                     which one inference on A3 wants is not verified here).

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
import torch.distributed as dist

from . import int4
from .collective_matmul import process_group
from .quant import dispatch_format, format_of, pack_rows
from .torch_kernels import LoopKernels


ACL_FORMAT_FRACTAL_NZ = 29
FUSED_K_RANGE = (256, 65535)               # k in [256, 65535)
FUSED_WORLD_SIZES = {"A2": (2, 4, 8), "A3": (2, 4, 8, 16, 32)}


def hccl_comm_name(group) -> str:
    """The HCCL communicator name of `group` (torch_npu's ProcessGroupHCCL)."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank())


class NpuKernels(LoopKernels):
    name = "npu"

    def __init__(self, npu=None, quant_compute: str = "w8a16", comm_name=None):
        """`npu` stands in for torch_npu and `comm_name(group)` for its HCCL name (the tests' double)."""
        self.npu = npu if npu is not None else importlib.import_module("torch_npu")
        self.quant_compute = quant_compute
        self.comm_name = comm_name or hccl_comm_name
        self._mask_in, self._mask_out = None, None      # (mask, its version), inverted: _masked_positions
        self._hcom: dict = {}
        self._soc = None

    # ------------------------------------------------------------ communication fused with matmuls

    @property
    def soc(self) -> str:
        """"A2" or "A3": the recipe tells them apart by "Ascend910B" in the device name (A2); which
        names A3 reports (Ascend910_93xx) is not verified here: anything else is taken for A3."""
        if self._soc is None:
            self._soc = "A2" if "Ascend910B" in self.npu.npu.get_device_name() else "A3"
        return self._soc

    def _fused_fits(self, x, weight, group) -> bool:
        return (x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and x.dim() == 2
                and weight.dim() == 2 and FUSED_K_RANGE[0] <= x.shape[1] < FUSED_K_RANGE[1]
                and dist.get_world_size(group) in FUSED_WORLD_SIZES[self.soc])

    def _group_name(self, group) -> str:
        group = process_group(group)
        if group not in self._hcom:
            self._hcom[group] = self.comm_name(group)
        return self._hcom[group]

    def fused_form(self, op, x, weight, group):
        if not self._fused_fits(x, weight, group):
            return None
        if op == "all_gather_matmul":
            return ("npu_all_gather_base_mm",
                    lambda padded, wt, group, ranks: self.npu.npu_all_gather_base_mm(
                        padded, wt, self._group_name(group), ranks, gather_index=0, gather_output=False, comm_turn=0)[0])
        if self.soc == "A2":                # the recipe's own split on A2: a plain matmul + reduce-scatter
            return ("plain (A2)", None)
        return ("npu_mm_reduce_scatter_base",
                lambda padded, wt, group, ranks: self.npu.npu_mm_reduce_scatter_base(
                    padded, wt, self._group_name(group), ranks, reduce_op="sum", comm_turn=0))

    def expert_weight_storage(self, w):
        if w.dtype == int4.STORAGE_DTYPE:
            return self._int4pack(w)
        return self.npu.npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ)

    def _int4pack(self, stored):
        """A stored int4 stack [E, K, N/2] -> int32 [E, K, N/8] as npu_convert_weight_to_int4pack packs
        it (2-D int32 [K, N] in [-8, 7], N a multiple of 8), one expert's int32 values alive at a time.
        The op packs on the host (op-plugin: a copy to the CPU and back per call): once, at load.
        A stack whose N is not a multiple of 8 stays as stored and runs the dequantize reference."""
        experts, k, n = int4.unpacked_shape(stored.shape)
        if n % 8:
            return stored
        out = torch.empty(experts, k, n // 8, dtype=torch.int32, device=stored.device)
        for expert in range(experts):
            out[expert] = self.npu.npu_convert_weight_to_int4pack(int4.unpacked_values(stored[expert]).contiguous())
        return out

    def quant_compute_run(self, fmt, device):
        return int4.COMPUTE if int4.is_int4(fmt) else self.quant_compute

    def grouped_without_host_sync(self, x, w13, w2, scales):
        """npu_grouped_matmul takes its group_list as a device tensor in every form (bf16, int8 W8A16 /
        W8A8, int4): the fixed form runs sorted (fixed_shape.py), permute and unpermute being
        npu_moe_init_routing_v2 (expert_num = the local experts, every pair's key in range) and
        npu_moe_finalize_routing. Only an int4 stack left as stored runs the dequantize reference."""
        return not any(w.dtype == int4.STORAGE_DTYPE for w in (w13, w2))

    def grouped_matmul(self, x, w, counts):
        if x.shape[0] == 0:
            return x.new_empty(0, w.shape[-1])
        if w.shape[0] == 1:
            # One local expert (EP degree == expert count): group_list_type=1 rejects a length-1 list.
            return torch.matmul(x, w[0])
        # group_list_type=1: group_list holds per-group counts; split_item=2: one output tensor.
        return self.npu.npu_grouped_matmul([x], [w], group_list=counts.to(torch.int64), group_type=0,
                                           group_list_type=1, split_item=2)[0]

    def quantized_grouped_matmul(self, x, q, scale, counts, x_scale=None):
        """x [M, K] bf16 grouped by expert (counts [E]) @ dequantize(q [E, K, N] int8, scale [E, N] fp32).

        Docs (npu_grouped_matmul, group_list a Tensor, Atlas A2/A3): the weight-only form ("伪量化")
        takes x bf16, weight int8, antiquant_scale bf16 shaped [g, n] for one weight tensor, output
        bf16, y = x @ (weight * antiquant_scale); the per-token form takes x int8, weight int8,
        scale bf16 [g, n] with per_token_scale fp32 [m] and output_dtype bf16, y = (x @ weight) *
        scale * per_token_scale. The scales go to bf16 (the op's dtype rule): a relative change of at
        most 2^-9 per channel. group_list_type=1 rejects a length-1 list, so one local expert passes
        its cumsum (type 0, which has no length rule). `x_scale`: x is already int8 per token with
        these float32 scales (int8 dispatch), multiplied as it is."""
        if x.shape[0] == 0:
            return x.new_empty(0, scale.shape[-1])
        if q.dtype == torch.int32:                              # int4, packed by _int4pack
            return self._int4_grouped_matmul(x, q, scale, counts)
        if q.dtype == int4.STORAGE_DTYPE:                       # int4 left as stored (N not a multiple of 8)
            return super().quantized_grouped_matmul(x, q, scale, counts)
        fmt = format_of(q.dtype)
        if fmt != "int8":
            raise ValueError(f"quantize: {fmt or q.dtype} experts do not run on npu (npu_grouped_matmul takes int8 "
                             f"weights only); use --quantize int8")
        group_list, list_type = (counts.to(torch.int64), 1) if q.shape[0] > 1 else (counts.to(torch.int64).cumsum(0), 0)
        common = dict(group_list=group_list, group_type=0, group_list_type=list_type, split_item=2)
        if self.quant_compute == "w8a8":
            x_q, x_scale = (x, x_scale) if x_scale is not None else self.npu.npu_dynamic_quant(x.contiguous())
            return self.npu.npu_grouped_matmul([x_q], [q], scale=[scale.to(torch.bfloat16)],
                                               per_token_scale=[x_scale], output_dtype=torch.bfloat16, **common)[0]
        return self.npu.npu_grouped_matmul([x], [q], antiquant_scale=[scale.to(x.dtype)], **common)[0]

    def _int4_grouped_matmul(self, x, packed, scale, counts):
        """x [M, K] bf16 grouped by expert @ int4 experts (packed int32 [E, K, N/8], scale [E, K/G, N]):
        the weight-only grouped matmul, the scale in x's dtype (the op's dtype rule; the stored one is
        bf16 already). One local expert passes its cumsum (group_list_type 1 rejects a length-1 list)."""
        group_list, list_type = ((counts.to(torch.int64), 1) if packed.shape[0] > 1
                                 else (counts.to(torch.int64).cumsum(0), 0))
        return self.npu.npu_grouped_matmul([x], [packed], antiquant_scale=[scale.to(x.dtype)], group_list=group_list,
                                           group_type=0, group_list_type=list_type, split_item=2)[0]

    def dispatch_format(self, expert_format):
        return dispatch_format("npu", expert_format, self.quant_compute)

    def quantized_rows_matmul(self, x_q, x_scale, q, scale, counts):
        """int8 rows (per-token scales, as npu_dynamic_quant gives them) x int8 experts: the w8a8 op."""
        if self.quant_compute != "w8a8" or format_of(q.dtype) != "int8":
            return super().quantized_rows_matmul(x_q, x_scale, q, scale, counts)
        return self.quantized_grouped_matmul(x_q, q, scale, counts, x_scale=x_scale)

    def permute_quantized(self, x, topk_idx, num_experts):
        if x.shape[0] == 0:
            return super().permute_quantized(x, topk_idx, num_experts)
        # quant_mode 1: each expanded row quantized dynamically (scale = max|row| / 127, as
        # npu_dynamic_quant per token), the scales [T*K] float32 as the 4th output.
        q, row_idx, counts, scale = self.npu.npu_moe_init_routing_v2(
            x, topk_idx.to(torch.int32), active_num=topk_idx.numel(), expert_num=num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
            quant_mode=1, row_idx_type=0)
        return pack_rows(q, scale), row_idx, counts.to(torch.int64)

    def regroup_quantized(self, q, scale, counts_per_rank):
        if q.shape[0] == 0:
            return super().regroup_quantized(q, scale, counts_per_rank)
        grouped, grouped_scale, order, local_counts = self.npu.npu_moe_re_routing(
            q, counts_per_rank, per_token_scales=scale, expert_token_num_type=1, idx_type=0)
        return grouped, grouped_scale, order, local_counts.to(torch.int64)

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
