"""The names the kernel layer answers to, without torch: the devices, the routed experts' formats and
how quantized experts compute. The launcher and the request schema check a job against these before
any process of it imports torch (importing adaptor_patches.kernels imports torch: ~2 s of CPU at
every `run.sh`). kernels/device.py, int4.py and quant.py take their names from here."""
from __future__ import annotations

BACKEND_KINDS = ("npu", "cuda", "cpu")
DEVICE_CHOICES = ("auto",) + BACKEND_KINDS

INT4 = "int4"
INT4_GROUP_SIZES = (32, 64, 128, 256)       # the group sizes torch's int4 matmul takes
INT4_DEFAULT_GROUP = 128
INT4_COMPUTE = "w4a16"


def int4_format_name(group: int = INT4_DEFAULT_GROUP) -> str:
    """The expert format of groups of `group` input channels ("int4" for the default 128)."""
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group} is not one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    return INT4 if group == INT4_DEFAULT_GROUP else f"{INT4}-g{group}"


INT4_FORMATS = tuple(int4_format_name(g) for g in sorted(INT4_GROUP_SIZES, key=lambda g: g != INT4_DEFAULT_GROUP))
EIGHT_BIT = ("int8", "fp8")
EXPERT_FORMATS = EIGHT_BIT + INT4_FORMATS

QUANT_COMPUTES = ("w8a16", "w8a8", INT4_COMPUTE)
COMPUTE_MEANS = {"w8a16": "8-bit weights, activations in bf16",
                 "w8a8": "8-bit weights, activations quantized per token",
                 INT4_COMPUTE: "4-bit weights, activations in bf16"}
OLD_COMPUTE_NAMES = {"weight": "w8a16", "8bit": "w8a8"}      # --quant-compute's spellings before issue 27
