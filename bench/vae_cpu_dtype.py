"""CPU VAE decode: the checkpoint's bf16 vs fp32 (what compat's decode shim uses on CPU), side by side.

    .venv/bin/python bench/vae_cpu_dtype.py [--model DIR] [--size 64] [--repeat 3] [--threads 1]

Loads the VAE of a tiny checkpoint (built at DIR, default models/tiny, when missing) with upstream's
own `from_pretrained`, decodes the same random latents of an HxH image in both dtypes and prints
the median seconds and the ratio, plus the largest pixel difference between the two decodes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
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
    for dtype in (torch.bfloat16, torch.float32):
        vae.to(dtype)
        times = []
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for _ in range(args.repeat):
                start = time.perf_counter()
                decoded[dtype] = vae.decoder(latents.to(dtype)).float()
                times.append(time.perf_counter() - start)
        rows.append((str(dtype).replace("torch.", ""), statistics.median(times)))
    diff = (decoded[torch.bfloat16] - decoded[torch.float32]).abs().max().item()
    print(f"VAE decode, {args.size}x{args.size}, {args.threads} thread(s), median of {args.repeat}")
    print("| dtype | decode (s) | vs fp32 |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / rows[-1][1]:.1f}x |")
    print(f"max |bf16 - fp32| over the decoded pixels ([-1, 1] range): {diff:.3g}")


if __name__ == "__main__":
    main()
