"""TEST DOUBLE of torch's fp8 grouped GEMM (scaled_grouped_mm, rowwise scales, 2-D x 3-D), of its CUDA
int4 weight-only matmul (`int4pack` below) and of the symmetric-memory fused collective matmuls
(`symm_mem` below) -- plain torch, tests only.

Called as kernels/cuda.py calls torch's: fn(a, b, scale_a, scale_b, offs) -> bf16. It checks what
torch's own checks (torch/_meta_registrations.py, _meta_grouped_mm_common) require for this case,
so a wrong call in the CUDA form fails on CPU, and computes the documented product:

    out[rows of group g] = (a[rows].float() * scale_a[rows, None]) @ (b[g].float() * scale_b[g][None, :])

a float8_e4m3fn [M, K] row-major; b float8_e4m3fn [G, K, N] column-major in its last two dims;
scale_a float32 [M] contiguous; scale_b float32 [G, N]; offs int32 [G], group end offsets,
non-decreasing (read strictly: the last equals M); K and N multiples of 16 (16-byte strides).
Not checked on a GPU.

    make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm)
"""
from __future__ import annotations

import torch

IS_TEST_DOUBLE = True     # harness/host_syncs.py: what a double does inside is the device op's, not counted
calls: list = []          # (M, K, N, G) of every call, for tests to inspect


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"cuda_double: {message}")


def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    fp8 = torch.float8_e4m3fn
    _require(a.dtype == fp8 and b.dtype == fp8, f"expected E4M3 FP8 inputs, got {a.dtype} and {b.dtype}")
    _require(a.dim() == 2 and b.dim() == 3, "the modelled case is a 2-D mat_a and a 3-D mat_b")
    _require(a.shape[1] == b.shape[1], "contraction dimension of mat_a and mat_b must match")
    _require(a.stride(-1) == 1 and a.stride(-2) > 1, f"mat_a must be row major, strides {a.stride()}")
    _require(b.stride(-2) == 1 and b.stride(-1) > 1, f"mat_b must be column major, strides {b.stride()}")
    _require(a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0, "K and N must be multiples of 16 (16-byte strides)")
    _require(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32, "scales must be float32")
    _require(scale_a.dim() == 1 and scale_a.shape[0] == a.shape[0] and scale_a.is_contiguous(),
             f"scale_a must be contiguous [M] = [{a.shape[0]}], got {list(scale_a.shape)}")
    _require(tuple(scale_b.shape) == (b.shape[0], b.shape[2]), f"scale_b must be [G, N], got {list(scale_b.shape)}")
    _require(offs is not None and offs.dtype == torch.int32 and offs.shape == (b.shape[0],),
             "offs must be int32 [G] group end offsets")
    ends = offs.tolist()
    _require(all(x <= y for x, y in zip([0] + ends, ends)) and ends[-1] == a.shape[0],
             f"offs {ends} must be non-decreasing and end at M = {a.shape[0]}")
    calls.append((a.shape[0], a.shape[1], b.shape[2], b.shape[0]))
    out = torch.empty(a.shape[0], b.shape[2], dtype=torch.float32)
    start = 0
    for g, end in enumerate(ends):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = rows @ (b[g].float() * scale_b[g][None, :])
        start = end
    return out.to(torch.bfloat16)


class symm_mem:
    """TEST DOUBLE of torch.ops.symm_mem's fused collective matmuls (torch.distributed._symmetric_memory),
    over the group torch resolves `group_name` to (gloo here). Checks as torch's implementations
    check (_fused_all_gather_matmul_impl, _fused_matmul_reduce_scatter_impl) plus what their
    collectives need: the gathered / scattered dim splits evenly over the group.

        CudaKernels(symm_mem=cuda_double.symm_mem)
    """

    calls: list = []                     # the fused ops' names, in call order

    @staticmethod
    def _group(group_name):
        from torch.distributed import distributed_c10d as c10d
        return c10d._resolve_process_group(group_name)

    @staticmethod
    def fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True):
        import torch.distributed as dist
        _require(A_shard.dim() >= 2, "A_shard must be a matrix")
        _require(all(B.dim() == 2 for B in Bs), "B must be a matrix")
        _require(0 <= gather_dim < A_shard.dim(), "Invalid gather_dim")
        _require(all(B.shape[0] == A_shard.shape[-1] and B.dtype == A_shard.dtype for B in Bs),
                 "B must be [K, N] of A_shard's dtype")
        group = symm_mem._group(group_name)
        symm_mem.calls.append("fused_all_gather_matmul")
        n = dist.get_world_size(group)
        flat = A_shard.movedim(gather_dim, 0).contiguous()
        gathered = flat.new_empty(n * flat.shape[0], *flat.shape[1:])
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, flat, group=group)
        A = gathered.movedim(0, gather_dim)
        outs = [(A.float() @ B.float()).to(A.dtype) for B in Bs]
        return (A if return_A else None), outs

    @staticmethod
    def fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
        import torch.distributed as dist
        _require(A.dim() >= 2, "A_shard must be a matrix")
        _require(0 <= scatter_dim < A.dim(), "Invalid gather_dim")
        _require(B.dim() == 2 and B.shape[0] == A.shape[-1], "B must be a [K, N] matrix")
        _require(reduce_op in ("sum", "avg"), "reduce_op must be sum or avg")
        group = symm_mem._group(group_name)
        n = dist.get_world_size(group)
        _require(A.shape[scatter_dim] % n == 0, f"dim {scatter_dim} of A ({A.shape[scatter_dim]}) must split over {n}")
        symm_mem.calls.append("fused_matmul_reduce_scatter")
        product = (A.float() @ B.float()).to(A.dtype).movedim(scatter_dim, 0).contiguous()
        out = product.new_empty(product.shape[0] // n, *product.shape[1:])
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, product, group=group)
        if reduce_op == "avg":
            out = out / n
        return out.movedim(0, scatter_dim)


class int4pack:
    """TEST DOUBLE of torch's CUDA int4 weight-only matmul pair, as kernels/cuda.py calls them:

        convert_weight_to_int4pack(w, inner_k_tiles)   torch.ops.aten._convert_weight_to_int4pack
        weight_int4pack_mm(x, w, group, scales_and_zeros)   torch._weight_int4pack_mm

    Checks what torch's checks require (aten/src/ATen/native/cuda/int4mm.cu, _meta_registrations):
    w uint8 [N, K/2] contiguous (two uint4 a byte, the even K index in the high nibble: the packing
    torchao's tensor-core-tiled layout feeds it), inner_k_tiles 2 / 4 / 8, K a multiple of
    16 x inner_k_tiles, N a multiple of 8; the packed weight int32 [N/8, K/(16 t), 32, t/2] (its
    inner order is the GPU's; here the uint4 values, 8 to an int32, in an order of the double's own,
    so the caller can only hand it back to weight_int4pack_mm). The matmul: x bf16 [M, K] contiguous,
    group 32/64/128/256 dividing K, scales_and_zeros bf16 [K/group, N, 2] contiguous;
    out = x @ ((u - 8) * scale + zero) (fp32 here), bf16. Not checked on a GPU.

        CudaKernels(int4_ops=cuda_double.int4pack)
    """

    calls: list = []                     # ("convert" | "mm", shapes) in call order

    @staticmethod
    def convert_weight_to_int4pack(w, inner_k_tiles):
        _require(w.dtype == torch.uint8 and w.dim() == 2, f"expected a 2-D uint8 weight [N, K/2], got {w.dtype} "
                                                          f"{w.dim()}-D")
        _require(w.is_contiguous(), "weight must be contiguous")
        _require(inner_k_tiles in (2, 4, 8), f"innerKTiles must be 2, 4, or 8, got {inner_k_tiles}")
        n, k = w.shape[0], w.shape[1] * 2
        _require(n % 8 == 0, f"the N dimension ({n}) must be divisible by 8")
        _require(k % (inner_k_tiles * 16) == 0, f"K ({k}) must be divisible by {inner_k_tiles * 16}")
        int4pack.calls.append(("convert", (n, k, inner_k_tiles)))
        wide = w.to(torch.int64)
        uint4 = torch.stack([wide >> 4, wide & 0xF], dim=-1).reshape(n, k)          # high nibble: even k
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        packed = (uint4.reshape(-1, 8) << shifts).sum(-1)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return packed.reshape(n // 8, k // (inner_k_tiles * 16), 32, inner_k_tiles // 2)

    @staticmethod
    def _uint4(w):
        tiles = w.shape[3] * 2
        n, k = w.shape[0] * 8, w.shape[1] * tiles * 16
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        return ((w.reshape(-1).to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(n, k)

    @staticmethod
    def weight_int4pack_mm(x, w, group, scales_and_zeros):
        _require(x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), "x must be 2-D contiguous bf16")
        _require(w.dtype == torch.int32 and w.dim() == 4, "the packed weight must be 4-D int32")
        n, k = w.shape[0] * 8, w.shape[1] * w.shape[3] * 2 * 16
        _require(x.shape[1] == k, f"x has K {x.shape[1]}, the packed weight {k}")
        _require(group in (32, 64, 128, 256) and k % group == 0, f"qGroupSize {group} must be 32/64/128/256 dividing K")
        sz = scales_and_zeros
        _require(sz.dtype == torch.bfloat16 and tuple(sz.shape) == (k // group, n, 2) and sz.is_contiguous(),
                 f"qScaleAndZeros must be contiguous bf16 [{k // group}, {n}, 2], got {sz.dtype} {list(sz.shape)}")
        int4pack.calls.append(("mm", (x.shape[0], k, n, group)))
        weight = (int4pack._uint4(w).t().float() - 8) * sz[..., 0].float().repeat_interleave(group, 0) \
            + sz[..., 1].float().repeat_interleave(group, 0)
        return (x.float() @ weight).to(torch.bfloat16)
