"""Who decodes the image without VAE parallel: rank 0 alone (today) vs every rank (before issue 34's
cut), side by side in one run, on 2 gloo ranks of the CPU.

    .venv/bin/python bench/rank_decode.py [--model DIR] [--layout cfg2|tp2] [--rounds 2]

The tiny Instruct checkpoint (models/tiny_instruct, built if missing), upstream's generate_image:
an edit of upstream's demo input at 256x256, 2 steps, seed 7, one thread per rank. Each variant is
one call on harness/multirank.py's pool of 2 gloo ranks (as bench/comm.py runs); per rank: the VAE
decode's CPU seconds (process time around `vae.decode`, the least over --rounds) and whether its
image is rank 0's. Only rank 0 writes or answers (run_image_gen, the server), so the other ranks'
images are never read; "every rank" is today's code with the other ranks' zero image replaced by
upstream's decode (the wrapped Decoder.forward).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

IMAGE = ROOT / "assets" / "demo_instruct_imgs" / "input_0_0.png"
LAYOUTS = {"cfg2": {"cfg_parallel": True}, "tp2": {}}
VARIANTS = ("rank 0 decodes", "every rank decodes")


def decode_on_rank(rank: int, world_size: int, model_dir: str, flags: dict, every_rank: bool, rounds: int) -> tuple:
    """One rank of harness/multirank.py's pool: (least decode CPU s, its image equals rank 0's, its image is not
    one flat colour)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from adaptor_patches import autoencoder_kl_3d
    from adaptor_patches.parallel.layout import Layout
    from utils.runtime.engine.rank_model import load_rank_model
    unread_image = autoencoder_kl_3d.unread_image
    if every_rank:          # the pool's next call must find today's code: restored below
        autoencoder_kl_3d.unread_image = lambda decoder, z: type(decoder).forward.__wrapped__(decoder, z)
    try:
        model, _ = load_rank_model(model_dir, "cpu", layout=Layout.from_flags(world_size, **flags), rank=rank)
        decode_cpu, real_decode = [], model.vae.decode

        def timed_decode(*args, **kwargs):
            start = time.process_time()
            try:
                return real_decode(*args, **kwargs)
            finally:
                decode_cpu.append(time.process_time() - start)
        model.vae.decode = timed_decode
        for _ in range(rounds):
            _, images = model.generate_image(prompt="make it a watercolor painting", image=str(IMAGE), seed=7,
                                             image_size="256x256", bot_task="image", use_system_prompt="None",
                                             diff_infer_steps=2)
    finally:
        autoencoder_kl_3d.unread_image = unread_image
    pixels = torch.from_numpy(np.asarray(images[0].convert("RGB")).copy())
    gathered = [torch.empty_like(pixels) for _ in range(world_size)]
    dist.all_gather(gathered, pixels)
    return min(decode_cpu), torch.equal(pixels, gathered[0]), bool((pixels != pixels.flatten()[0]).any())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny_instruct")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="cfg2")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    from bench.rank_decode import decode_on_rank        # importable by the pool's ranks by this name
    from harness.multirank import close_pools, run_ranks
    from utils.make_tiny_model import ensure_tiny_model
    model_dir = str(ensure_tiny_model(args.model, "instruct"))
    print(f"tiny Instruct, 256x256 edit, 2 steps, 2 ranks ({args.layout}), least decode CPU of {args.rounds} rounds\n")
    print("| variant | rank 0 decode (CPU s) | rank 1 decode (CPU s) | rank 1's image "
          "| ranks' decode CPU vs every rank |")
    print("|---|---|---|---|---|")
    try:
        rows = {variant: run_ranks(2, decode_on_rank, model_dir, LAYOUTS[args.layout], variant == VARIANTS[1],
                                   args.rounds, timeout_s=900) for variant in VARIANTS}
    finally:
        close_pools()
    every = sum(cpu for cpu, _, _ in rows[VARIANTS[1]])
    for variant, ((cpu0, _, _), (cpu1, same, drawn)) in rows.items():
        image = "rank 0's" if same else ("one flat colour (not read)" if not drawn else "differs")
        print(f"| {variant} | {cpu0:.2f} | {cpu1:.2f} | {image} | {(cpu0 + cpu1) / every:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
