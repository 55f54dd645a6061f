"""TEST DOUBLE of torch's fp8 grouped GEMM (scaled_grouped_mm, rowwise scales, 2-D x 3-D) and of the
symmetric-memory fused collective matmuls (`symm_mem` below) -- plain torch, tests only.

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
