"""One tiny Instruct (or Instruct-Distil) edit per run, several runs in one process: the self-check's
instruct section runs it in a subprocess (a hang or a crash stays there).

    python -m utils.selfcheck.instruct_generate --model DIR --image PNG --steps N --out DIR \\
        --run cpu:cpu:full --run cuda:cuda:full            (NAME:DEVICE:ADAPTOR, ADAPTOR full | shims)

Each run loads the checkpoint under the adaptor (`shims`: upstream eager) on its device, edits the image
through upstream's own generate_image (256x256, bot_task image, no system prompt, seed 7, the initial
noise and the conditioning latent's sample drawn on the CPU), and writes DIR/NAME.png and DIR/NAME.pt
(the final latents). One `error:` line and exit 1 when a run fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPT = "make it a watercolor painting"
SEED = 7


def run_one(model_dir: Path, image: str, steps: int, out: Path, name: str, kind: str, adaptor: str) -> None:
    import torch
    import model_adaptor
    from adaptor_patches.kernels.device import resolve
    from adaptor_patches.metrics import PhaseTimer
    from utils.runtime.engine.outputs import write_atomically
    from utils.runtime.engine.rank_model import load_rank_model
    try:
        with torch.no_grad():
            model, context = load_rank_model(model_dir, resolve(kind, 0, cpu_noise=True), shims_only=adaptor == "shims",
                                             per_rank=adaptor == "full")
            timer = PhaseTimer(context.device).attach(model)
            _, images = model.generate_image(prompt=PROMPT, image=image, seed=SEED, image_size="256x256",
                                             bot_task="image", use_system_prompt="None", diff_infer_steps=steps)
        write_atomically(out / f"{name}.png", lambda tmp: images[0].save(tmp, format="PNG"))
        write_atomically(out / f"{name}.pt", lambda tmp: torch.save(timer.last_latents, tmp))
    finally:
        model_adaptor.remove()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="instruct_generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--run", action="append", default=[], help="NAME:DEVICE:ADAPTOR")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.run:
        name, kind, adaptor = spec.split(":")
        try:
            run_one(args.model, args.image, args.steps, args.out, name, kind, adaptor)
        except Exception as exc:           # the section reports it as the run's row
            print(f"error: {name}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                  file=sys.stderr, flush=True)
            return 1
        print(f"{name}: done", flush=True)
    return 0


if __name__ == "__main__":
    from utils.runtime.engine.rank_console import route_console
    route_console(0)
    sys.exit(main())
