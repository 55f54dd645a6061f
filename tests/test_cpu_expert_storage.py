"""The CPU kernel set stores expert weights [out, in]-major and its grouped matmul reads them in place.

Why (docs/BENCHMARKS.md, issue 24 part 7): on a CPU without native bf16 (AVX2) a bf16 `x @ w[e]`
ran 2.5-3x slower on [in, out]-major weights than on [out, in]-major ones, nn.Linear's layout.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptor_patches.kernels import make_kernels


class _CopiedBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("copy_", "clone", "_to_copy")) and isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
        return out


def test_cpu_expert_storage_is_out_in_major_with_the_same_values_and_results():
    kernels, loop = make_kernels("cpu"), make_kernels("loop")
    torch.manual_seed(0)
    w13, w2 = torch.randn(4, 64, 96), torch.randn(4, 48, 64)
    stored13, stored2 = kernels.expert_weight_storage(w13), kernels.expert_weight_storage(w2)
    assert stored13.shape == w13.shape and torch.equal(stored13, w13) and torch.equal(stored2, w2)
    assert stored13.stride() == (64 * 96, 1, 64) and stored2.stride() == (48 * 64, 1, 48)
    x, counts = torch.randn(40, 64), torch.tensor([10, 0, 20, 10])
    out = kernels.grouped_matmul(x, stored13, counts)
    assert (out - loop.grouped_matmul(x, w13, counts)).abs().max() < 1e-4


def test_cpu_grouped_matmul_does_not_copy_the_weights():
    kernels = make_kernels("cpu")
    w = torch.randn(4, 96, 64).transpose(1, 2)          # [E, in, out] stored [out, in]-major
    x, counts = torch.randn(40, 64), torch.tensor([10, 5, 20, 5])
    with _CopiedBytes() as copies:
        kernels.grouped_matmul(x, w, counts)
    assert copies.largest < w[0].numel(), f"a copy of {copies.largest} elements (a weight has {w[0].numel()})"
