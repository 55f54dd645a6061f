"""The VAE's convolutions through the device layer's conv3d (kernels/device.py; the PATCHES row on
upstream's Conv3d.forward): on CPU in fp32 oneDNN's convolution instead of torch's im2col
slow_conv3d, the same sums within fp32 rounding. Measured: tiny VAE 256x256 decode, 1 thread,
docs/BENCHMARKS.md."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import model_adaptor
from adaptor_patches.kernels.device import conv3d

pytestmark = pytest.mark.usefixtures("unpatched_upstream")
REL_TOL = 1e-5


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def aten_ops(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("kernel,stride,padding,groups,bias", [
    (3, (1, 1, 1), (1, 1, 1), 1, True),       # the resnet blocks' convs
    (3, (1, 2, 2), (0, 0, 0), 1, True),       # a downsample after its own padding
    (1, (1, 1, 1), (0, 0, 0), 1, False),      # the attention's and shortcut's 1x1x1
    (3, (1, 1, 1), (1, 0, 1), 2, True),       # vae_bands' band conv: no height padding; groups
])
def test_conv3d_equals_torchs_and_runs_onednn_on_cpu(kernel, stride, padding, groups, bias):
    torch.manual_seed(0)
    x = torch.randn(1, 8, 3, 20, 18)
    w = torch.randn(12, 8 // groups, kernel, kernel, kernel)
    b = torch.randn(12) if bias else None
    want = F.conv3d(x, w, b, stride, padding, 1, groups)
    got, ops = aten_ops(lambda: conv3d(x, w, b, stride, padding, (1, 1, 1), groups))
    assert got.shape == want.shape and rel_err(got, want) <= REL_TOL
    assert "aten::mkldnn_convolution" in ops and "aten::slow_conv3d_forward" not in ops, ops


def test_bf16_and_non_contiguous_inputs_keep_torchs_conv():
    x = torch.randn(1, 4, 2, 8, 8)
    w = torch.randn(4, 4, 3, 3, 3)
    got = conv3d(x.bfloat16(), w.bfloat16(), None, (1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    assert torch.equal(got, F.conv3d(x.bfloat16(), w.bfloat16(), None, 1, 1))
    strided = x.transpose(3, 4)
    assert rel_err(conv3d(strided, w, None, (1, 1, 1), (1, 1, 1), (1, 1, 1), 1), F.conv3d(strided, w, None, 1, 1)) <= REL_TOL


def test_the_patched_vae_decodes_as_upstreams_without_slow_conv3d(tiny_instruct):
    """The tiny Instruct VAE (random weights, not zero-initialised) decodes a 128x128 latent as upstream's
    Conv3d does within fp32 rounding, and no convolution of it takes torch's slow path."""
    from hunyuan_image_3 import autoencoder_kl_3d as ae
    config = json.loads((tiny_instruct / "config.json").read_text())["vae"]
    torch.manual_seed(0)
    model_adaptor.apply("cpu", shims_only=True)        # compat's shim: the VAE's __init__ asks for a CUDA tensor
    vae = ae.AutoencoderKLConv3D(**config).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.05)
        z = torch.randn(1, config["latent_channels"], 1, 8, 8)
        want, upstream_ops = aten_ops(lambda: vae.decode(z).sample)
        model_adaptor.apply("cpu")
        got, ops = aten_ops(lambda: vae.decode(z).sample)
    assert "aten::slow_conv3d_forward" in upstream_ops
    assert "aten::slow_conv3d_forward" not in ops and "aten::mkldnn_convolution" in ops
    assert got.shape == want.shape and rel_err(got, want) <= 1e-4, rel_err(got, want)
