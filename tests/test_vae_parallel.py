"""VAE-parallel decode (parallel/vae_bands.py, autoencoder_kl_3d.py) equals single-device decode.

The VAE is upstream's own AutoencoderKLConv3D built from the tiny model's `vae` config, in fp32,
with every constant parameter (zero biases, unit GroupNorm weights) re-randomised under a fixed
seed so that no branch passes vacuously. Each world size is one spawned gloo job through
`model_adaptor.apply(...)`, i.e. the PATCHES row itself; the reference is the unpatched decode in
this process. Tolerance: max |parallel - single| <= 1e-4 x max |single| (fp32).
"""
import contextlib

import pytest
import torch
from torch import nn

import model_adaptor
from adaptor_patches.kernels import make_kernels
from adaptor_patches.parallel import vae_bands
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks

REL_TOL = 1e-4
# name -> (batch, latent rows, latent cols)
CASES = {
    2: {"even_batch2": (2, 8, 6), "odd_5x7": (1, 5, 7)},
    4: {"uneven_6x5": (1, 6, 5), "odd_5x7": (1, 5, 7), "two_rows": (1, 2, 3), "one_row": (2, 1, 4)},
}
GROUP_NORM_ROWS = {2: [5, 2], 4: [3, 1, 0, 3]}  # uneven bands, one empty


def build_vae():
    from hunyuan_image_3.autoencoder_kl_3d import AutoencoderKLConv3D
    from utils.make_tiny_model import resolve_sizes, sub_configs
    torch.manual_seed(0)
    vae = AutoencoderKLConv3D.from_config(sub_configs(resolve_sizes())["vae"]).float().eval()
    with torch.no_grad():
        for param in vae.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(0.3 * torch.randn_like(param))
    return vae


def latent(batch, rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, 1, rows, cols, generator=generator)


def decode(vae, z):
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def group_norm_check(rank, rows):
    """Bands.group_norm on uneven bands vs nn.GroupNorm on the whole map (row-dependent offsets,
    so per-band statistics differ from the whole map's)."""
    torch.manual_seed(1)
    norm = nn.GroupNorm(32, 64, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(64))
        norm.bias.add_(torch.randn(64))
    x = torch.randn(2, 64, 2, sum(rows), 5) * 3 + torch.arange(sum(rows)).view(1, 1, 1, -1, 1)
    bands = vae_bands.Bands(rows, rank, None, make_kernels("loop"))
    got = bands.group_norm(norm, bands.take(x))
    want = bands.take(norm(x))
    return got.shape == want.shape, (got - want).abs().max().item() if got.numel() else 0.0


def vae_for(world_size, rank, vae_parallel):
    """The same VAE (seeded), built under the adaptor for one rank of a layout."""
    device = model_adaptor.apply("cpu")
    with building(RankContext(Layout(world_size, vae_parallel=vae_parallel), rank, device)):
        return build_vae()


@contextlib.contextmanager
def counting_band_decodes():
    """Count the decodes that take the band path (vae_bands.parallel_decode, which the patched
    Decoder.forward calls): a decoder that fell back to upstream's single-device forward
    (decoder_init only logs why) gives the same image and would pass every equality below."""
    real, calls = vae_bands.parallel_decode, []

    def counted(decoder, z, group):
        calls.append(tuple(z.shape))
        return real(decoder, z, group)
    vae_bands.parallel_decode = counted
    try:
        yield calls
    finally:
        vae_bands.parallel_decode = real


def _rank_job(rank, world_size):
    vae = vae_for(world_size, rank, vae_parallel=True)
    with counting_band_decodes() as band_decodes:
        decoded = {name: decode(vae, latent(*size, seed=i))
                   for i, (name, size) in enumerate(CASES[world_size].items())}
    group_norm = group_norm_check(rank, GROUP_NORM_ROWS[world_size])
    # vae_parallel off: rank 0 decodes its own latent alone (a split decode would mix the ranks'
    # latents); the other ranks' images are never read, so they run no convolution at all.
    off = vae_for(world_size, rank, vae_parallel=False)
    convs = []
    hooks = [m.register_forward_hook(lambda *_: convs.append(1)) for m in off.decoder.modules()
             if isinstance(m, nn.Conv3d)]
    with counting_band_decodes() as alone_band_decodes:
        alone = decode(off, latent(1, 4, 3, seed=100 + rank))
    for hook in hooks:
        hook.remove()
    band_path = {"decodes": len(band_decodes), "split_problem": vae.decoder.band_split_problem,
                 "decodes_when_off": len(alone_band_decodes), "convs_when_off": len(convs)}
    model_adaptor.remove()
    # numpy, not tensors: torch's queue would share tensor memory with a rank that is exiting.
    return {name: out.numpy() for name, out in decoded.items()}, group_norm, alone.numpy(), band_path


@pytest.fixture(scope="module")
def vae():
    with model_adaptor.applied("cpu", shims_only=True):     # upstream's VAE allocates on CUDA in its __init__
        return build_vae()


@pytest.fixture(scope="module")
def jobs():
    """world size -> every rank's results, one spawned job per world size."""
    results = {}

    def run(world_size):
        if world_size not in results:
            results[world_size] = run_ranks(world_size, _rank_job)
        return results[world_size]
    return run


def assert_close(got, want, label):
    got = torch.from_numpy(got)
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= REL_TOL * scale, f"{label}: max abs error {err:.3g} > {REL_TOL} x {scale:.3g}"


def check_cases(results, world_size, vae, names):
    for i, (name, size) in enumerate(CASES[world_size].items()):
        if name in names:
            want = decode(vae, latent(*size, seed=i))
            for rank, (decoded, _, _, _) in enumerate(results):
                assert_close(decoded[name], want, f"{world_size} ranks, {name}, rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_decode_equals_single_device(jobs, vae, world_size):
    check_cases(jobs(world_size), world_size, vae, {"even_batch2", "uneven_6x5"})


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_parallel_decode_took_the_band_path(jobs, world_size):
    for rank, (_, _, _, band_path) in enumerate(jobs(world_size)):
        assert {k: v for k, v in band_path.items() if k != "convs_when_off"} == \
            {"decodes": len(CASES[world_size]), "split_problem": None, "decodes_when_off": 0}, (rank, band_path)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_odd_latent_sizes_equal_single_device(jobs, vae, world_size):
    check_cases(jobs(world_size), world_size, vae, {"odd_5x7"})


@pytest.mark.slow
def test_latent_smaller_than_rank_grid_equals_single_device(jobs, vae):
    check_cases(jobs(4), 4, vae, {"two_rows", "one_row"})


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_group_norm_stats_equal_single_device_on_uneven_bands(jobs, world_size):
    for rank, (_, (same_shape, err), _, _) in enumerate(jobs(world_size)):
        assert same_shape and err <= 1e-4, f"rank {rank}: GroupNorm max abs error {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_only_rank_0_decodes_when_vae_parallel_off(jobs, vae, world_size):
    for rank, (_, _, alone, band_path) in enumerate(jobs(world_size)):
        want = decode(vae, latent(1, 4, 3, seed=100 + rank))
        if rank == 0:
            assert band_path["convs_when_off"] > 0
            assert_close(alone, want, "vae-parallel off, rank 0")
        else:       # an image nobody reads: its shape, zeros, not one convolution run for it
            assert (band_path["convs_when_off"], alone.shape, alone.any()) == (0, tuple(want.shape), False), rank


def test_single_process_runs_upstream_forward(vae):
    from hunyuan_image_3.autoencoder_kl_3d import Decoder
    from unittest import mock
    original = Decoder.forward
    z = latent(1, 3, 2, seed=7)
    try:
        patched = vae_for(1, 0, vae_parallel=True)
        assert Decoder.forward is not original, "the PATCHES row must rebind Decoder.forward"
        with mock.patch.object(Decoder, "forward", original):       # the other rows (its convs') stay
            want = decode(patched, z)
        assert torch.equal(decode(patched, z), want)
    finally:
        model_adaptor.remove()
    assert Decoder.forward is original
