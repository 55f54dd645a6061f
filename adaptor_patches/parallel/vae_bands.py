"""VAE-parallel decode: the VAE decoder runs on horizontal bands of the latent, one per rank.

Called by the patched `Decoder.forward` (adaptor_patches/autoencoder_kl_3d.py), under compat's
`AutoencoderKLConv3D.decode` shim (dtype, autocast), when the layout has vae_parallel over more
than one rank; otherwise upstream's forward runs untouched.

Split: the latent's rows are dealt out in contiguous bands over every rank of the "vae" group
(RankContext.group("vae"): every rank of the job), the first `rows % ranks` ranks one row more.
With fewer rows than ranks the last ranks hold empty bands: they compute nothing but still join
every collective. Each spatial upsample doubles every band.
Every step gives the single-device result:
  - convolutions: a band is extended by its neighbours' edge rows (kernels.exchange with the rank above
    and the rank below; zero rows at the image border, as the conv's own zero padding would give),
    then convolved with no height padding;
  - GroupNorm: per-band mean and variance per group in fp32, all-gathered and merged by band size
    (Chan's parallel variance), so every rank normalises with the whole map's statistics;
  - mid-block attention: its input is all-gathered and normalised whole; each rank's own rows are
    the queries against keys and values of the whole map;
  - the decoded bands are all-gathered: every rank returns the same full image, as the pipeline's
    postprocess runs on every rank.
The walk below follows upstream's `Decoder` module tree and calls its weights functionally.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from ..kernels.device import conv3d
from .layout import split_evenly

log = logging.getLogger(__name__)


def swish(x):
    return x * torch.sigmoid(x)


class Bands:
    """This rank's band of a map split by rows over `group` (None: the default group), and the exact
    ops across bands. `rank` is this rank's index in the group; `kernels` the rank's kernel set, whose
    collectives (kernels/collectives.py) move the rows."""

    def __init__(self, rows: list, rank: int, group, kernels):
        self.rows = list(rows)
        self.rank = rank
        self.world = len(rows)
        self.group = group
        self.kernels = kernels

    def _peer(self, group_rank: int) -> int:
        """A band's owner as point-to-point ops name it (a global rank)."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    @property
    def empty(self) -> bool:
        return self.rows[self.rank] == 0

    def take(self, full):
        """This rank's rows of a whole map."""
        start = sum(self.rows[:self.rank])
        return full[..., start:start + self.rows[self.rank], :]

    def scale(self, factor: int) -> None:
        self.rows = [rows * factor for rows in self.rows]

    def gather(self, band):
        """The whole map from every rank's band (each padded to the tallest band for the collective)."""
        tallest = max(self.rows)
        padded = F.pad(band, (0, 0, 0, tallest - band.shape[-2]))
        parts = self.kernels.all_gather(padded.unsqueeze(0), self.group)
        return torch.cat([part[..., :rows, :] for part, rows in zip(parts, self.rows)], dim=-2)

    def conv(self, conv, band):
        """`conv` (a stride-1 Conv3d with same-size zero padding) of the whole map, on this band."""
        kernel_h, pad_h = conv.kernel_size[1], conv.padding[1]
        if self.empty:
            # No rows to compute; one dummy zero row yields the output's channels and dtype.
            dummy = band.new_zeros(*band.shape[:3], kernel_h, band.shape[-1])
            return conv_without_height_padding(conv, dummy)[..., :0, :]
        if pad_h:
            band = self._with_halo(band, pad_h)
        return conv_without_height_padding(conv, band)

    def _with_halo(self, band, rows):
        """`band` with `rows` rows above and below: the neighbouring bands' edge rows, zeros at the border."""
        edge_shape = (*band.shape[:3], rows, band.shape[-1])
        above, below = band.new_zeros(edge_shape), band.new_zeros(edge_shape)
        transfers = []
        if self.rank > 0:  # bands are filled from rank 0, so a non-empty band's upper neighbour is too
            transfers.append((band[..., :rows, :].contiguous(), above, self._peer(self.rank - 1)))
        if self.rank + 1 < self.world and self.rows[self.rank + 1]:
            transfers.append((band[..., -rows:, :].contiguous(), below, self._peer(self.rank + 1)))
        self.kernels.exchange(transfers)
        return torch.cat([above, band, below], dim=-2)

    def group_norm(self, norm, band):
        """`norm` (an nn.GroupNorm) applied to the whole map, on this band."""
        batch, channels = band.shape[:2]
        groups = band.float().reshape(batch, norm.num_groups, -1)
        if self.empty:
            stats = groups.new_zeros(2, batch, norm.num_groups)
        else:
            stats = torch.stack([groups.mean(-1), groups.var(-1, unbiased=False)])
        # [world, batch, groups] each
        band_means, band_vars = self.kernels.all_gather(stats.unsqueeze(0), self.group).unbind(1)
        # Every element count is rows x (channels per group x frames x width): weight bands by rows.
        weights = stats.new_tensor([rows / sum(self.rows) for rows in self.rows]).view(-1, 1, 1)
        mean = (weights * band_means).sum(0)
        var = (weights * (band_vars + (band_means - mean) ** 2)).sum(0)
        out = ((groups - mean[..., None]) * torch.rsqrt(var + norm.eps)[..., None]).reshape(band.shape)
        if norm.affine:
            per_channel = (1, channels) + (1,) * (band.dim() - 2)
            out = out * norm.weight.float().view(per_channel) + norm.bias.float().view(per_channel)
        # As nn.GroupNorm under CUDA autocast: fp32 out (the next conv casts down); else the input's dtype.
        autocast = torch.is_autocast_enabled(band.device.type)
        return out if autocast else out.to(band.dtype)


def conv_without_height_padding(conv, x):
    pad_t, _, pad_w = conv.padding
    return conv3d(x, conv.weight, conv.bias, conv.stride, (pad_t, 0, pad_w), conv.dilation, conv.groups)


def resnet_block(block, x, bands: Bands):
    h = bands.conv(block.conv1, swish(bands.group_norm(block.norm1, x)))
    h = bands.conv(block.conv2, swish(bands.group_norm(block.norm2, h)))
    if block.in_channels != block.out_channels:
        x = bands.conv(block.nin_shortcut, x)
    return x + h


def attention_block(block, x, bands: Bands):
    whole = block.norm(bands.gather(x))  # upstream's own GroupNorm on the whole map
    query = bands.conv(block.q, bands.take(whole))
    key, value = conv_without_height_padding(block.k, whole), conv_without_height_padding(block.v, whole)
    _, _, frames, rows, width = query.shape

    def tokens(t):
        return rearrange(t, "b c f h w -> b 1 (f h w) c").contiguous()

    out = F.scaled_dot_product_attention(tokens(query), tokens(key), tokens(value))
    out = rearrange(out, "b 1 (f h w) c -> b c f h w", f=frames, h=rows, w=width)
    return x + bands.conv(block.proj_out, out)


def upsample_dcae(upsample, x, bands: Bands):
    """UpsampleDCAE: conv, then channels to (time x) height x width; each band's rows double in place."""
    temporal = 2 if upsample.add_temporal_upsample else 1

    def to_space(t):
        return rearrange(t, "b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)", r1=temporal, r2=2, r3=2)

    h = to_space(bands.conv(upsample.conv, x))
    shortcut = to_space(x.repeat_interleave(repeats=upsample.repeats, dim=1))
    bands.scale(2)
    return h + shortcut


def decode_band(decoder, z_band, bands: Bands):
    """Upstream `Decoder.forward`, walked module by module on this rank's band."""
    repeats = decoder.block_out_channels[0] // decoder.z_channels
    h = bands.conv(decoder.conv_in, z_band) + z_band.repeat_interleave(repeats=repeats, dim=1)
    h = resnet_block(decoder.mid.block_1, h, bands)
    h = attention_block(decoder.mid.attn_1, h, bands)
    h = resnet_block(decoder.mid.block_2, h, bands)
    for level in decoder.up:
        for block in level.block:
            h = resnet_block(block, h, bands)
        if hasattr(level, "upsample"):
            h = upsample_dcae(level.upsample, h, bands)
    h = swish(bands.group_norm(decoder.norm_out, h))
    return bands.conv(decoder.conv_out, h)


def unsupported(decoder):
    """Why this decoder cannot be split by rows exactly, or None."""
    for name, module in decoder.named_modules():
        if isinstance(module, torch.nn.Conv3d):
            kernel_h, pad_h = module.kernel_size[1], module.padding[1]
            if (module.stride != (1, 1, 1) or module.dilation != (1, 1, 1) or module.groups != 1
                    or module.padding_mode != "zeros" or 2 * pad_h != kernel_h - 1 or pad_h > 1):
                return f"conv {name} is not a stride-1 'same' conv with at most one halo row"
        if name.endswith("upsample") and not hasattr(module, "repeats"):
            return f"{name} is not an UpsampleDCAE"
    return None


def check_same_latent_shape(z, group, kernels) -> None:
    """Every rank must hold a latent of one shape, or the band exchanges would mismatch."""
    shape = torch.tensor(z.shape, device=z.device)
    shapes = kernels.all_gather(shape.unsqueeze(0), group)
    if not bool((shapes == shape).all()):
        raise ValueError(f"vae-parallel: ranks hold latents of different shapes {shapes.tolist()}")


def parallel_decode(decoder, z, group):
    """The whole image on every rank of `group`, each rank having decoded one band of `z`'s rows."""
    # A collective first: it checks the shapes and means no rank's first call is point-to-point.
    kernels = decoder.rank_context.kernels
    check_same_latent_shape(z, group, kernels)
    world = dist.get_world_size(group)
    bands = Bands(split_evenly(z.shape[-2], world), dist.get_rank(group), group, kernels)
    if z.shape[-2] < world:
        log.info(f"vae-parallel: {z.shape[-2]} latent rows over {world} ranks; ranks {z.shape[-2]}..{world - 1} "
                 f"hold empty bands")
    return bands.gather(decode_band(decoder, bands.take(z), bands))
