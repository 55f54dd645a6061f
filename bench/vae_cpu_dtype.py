"""CPU VAE decode: the checkpoint's bf16 vs fp32 (what compat's decode shim uses on CPU) with torch's
own convolutions, and fp32 through the adaptor's conv3d (kernels/device.py: oneDNN's), side by side.

    .venv/bin/python bench/vae_cpu_dtype.py [--model DIR] [--size 64] [--repeat 3] [--threads 1] [--no-bf16]

Loads the VAE of a tiny checkpoint (built at DIR, default models/tiny, when missing) with upstream's
own `from_pretrained`, decodes the same random latents of an HxH image each way and prints the
median seconds and the ratio to fp32 with torch's convolutions, plus the largest pixel difference
of each decode from that one. `--no-bf16` leaves out the bf16 row (25x slower: minutes at 256).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-bf16", action="store_true")
    args = p.parse_args()

    import torch
    import model_adaptor
    from utils.make_tiny_model import ensure_tiny_model
    ensure_tiny_model(args.model)
    torch.set_num_threads(args.threads)
    model_adaptor.apply("cpu", shims_only=True)
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    vae = HunyuanImage3ForCausalMM.from_pretrained(str(args.model), dtype="auto").vae.eval()
    factor = vae.config.ffactor_spatial
    latents = torch.randn(1, vae.config.latent_channels, 1, args.size // factor, args.size // factor,
                          generator=torch.Generator().manual_seed(0))
    decoded, rows = {}, []
    ways = [("fp32, torch's conv3d", torch.float32, True), ("fp32, the adaptor's conv3d", torch.float32, False)]
    if not args.no_bf16:
        ways.insert(0, ("bf16, torch's conv3d", torch.bfloat16, True))
    for name, dtype, shims_only in ways:
        model_adaptor.apply("cpu", shims_only=shims_only)        # the full adaptor adds the Conv3d row
        vae.to(dtype)
        times = []
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for _ in range(args.repeat):
                start = time.perf_counter()
                decoded[name] = vae.decoder(latents.to(dtype)).float()
                times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times)))
    base = dict(rows)["fp32, torch's conv3d"]
    print(f"VAE decode, {args.size}x{args.size}, {args.threads} thread(s), median of {args.repeat}")
    print("| decode | seconds | vs fp32, torch's conv3d | max pixel diff from it ([-1, 1] range) |\n|---|---|---|---|")
    for name, seconds in rows:
        diff = (decoded[name] - decoded["fp32, torch's conv3d"]).abs().max().item()
        print(f"| {name} | {seconds:.3f} | {seconds / base:.2f}x | {diff:.3g} |")


if __name__ == "__main__":
    main()
