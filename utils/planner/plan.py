"""Will this layout fit? Per-rank memory, checkpoint reads and traffic, before a ten-minute load.

    python -m utils.planner --model-id DIR --world-size 16 --cfg-parallel --moe-ep --vae-parallel \\
        [--ulysses N] [--image-size 1024x1024] [--device npu|cuda|cpu] [--device-memory 64GiB] [--json PATH]
        [--quantize none|int8|fp8|int4|int4-g32|int4-g64|int4-g256] [--quant-compute w8a16|w8a8|w4a16] [--batch B]
    python -m utils.planner --model-id config/real_model --fit-table 64GiB,80GiB,141GiB [--quantize int4]
    bash run.sh CONFIG --plan                 (the same, from a launch config; run.sh plans every launch)

Only the checkpoint's config.json is read (config/real_model/ holds the published model's, for
planning without the weights). Numbers: utils/planner/memory_plan.py. Exit 2 when the layout does not fit
the given device memory (with --device-memory), with one `error:` line naming the rank role, the
shortfall and what would fit: another layout of the same ranks, int4 experts, fewer conditioning
images (Instruct), or the fewest cards of this format. `--fit-table` with `--quantize` adds one
table of the fewest cards per format (bf16, int8 and the one asked) and that format on one card.
With `--batch B` (requests per forward batch: the server's --max-batch, a prompts file's
--batch-size) a B whose activations do not fit is refused naming the largest B that does.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


from utils.planner.memory_plan import GiB, plan, shortfall
from adaptor_patches.kernels.device import BACKEND_KINDS
from adaptor_patches.kernels.quant import FORMATS, QUANT_COMPUTES

MEMORY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*\Z", re.I)
UNITS = {None: 1, "mib": 2**20, "mb": 10**6, "gib": 2**30, "gb": 10**9, "tib": 2**40, "tb": 10**12}
HEADROOM = 0.05          # of the device's memory, kept free on top of the plan (fragmentation, spikes)
FLAG_SETS = ((), ("--moe-ep",), ("--moe-tp",), ("--cfg-parallel",), ("--cfg-parallel", "--moe-ep"),
             ("--cfg-parallel", "--moe-tp"))


class PlanError(ValueError):
    """str() is `field: problem; fix`."""


def parse_memory(text, field: str = "device-memory") -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return int(text)
    match = MEMORY.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"{field}: {text!r} is not a memory size; write e.g. 64GiB or 80GB")
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").lower() or None])


def parse_size(text: str, config) -> tuple:
    """(height, width) the model will generate: upstream snaps any request to the bucket of its base
    size with the nearest aspect ratio (ResolutionGroup, the code that runs); auto -> the base square."""
    from hunyuan_image_3.tokenizer_wrapper import ResolutionGroup
    if text in (None, "auto"):
        height = width = config.image_base_size
    else:
        from utils.runtime.requests.request_schema import parse_image_size
        sides = parse_image_size(text)
        if sides is None:
            raise PlanError(f"image-size: {text!r} is not HxW; write e.g. 1024x1024")
        height, width = sides
    snapped_width, snapped_height = ResolutionGroup(base_size=config.image_base_size).get_target_size(width, height)
    return snapped_height, snapped_width


def layout_from(world_size: int, flags) -> object:
    from adaptor_patches.parallel.layout import Layout
    return Layout.from_flags(world_size, cfg_parallel="--cfg-parallel" in flags, moe_tp="--moe-tp" in flags,
                             moe_ep="--moe-ep" in flags, vae_parallel=True)


def gib(n) -> str:
    return f"{n / GiB:.2f}"


def experts_words(quantize) -> str:
    from adaptor_patches.kernels import int4
    group = int4.group_size(quantize)
    return f"{quantize} (4-bit, a scale per {group} input channels)" if group else (quantize or "bf16")


def report(roles, layout, image_size, device_memory=None, headroom=HEADROOM, quantize=None, batch: int = 1) -> str:
    experts = f", routed experts {experts_words(quantize)}" if quantize else ""
    batched = f", {batch} requests per forward batch" if batch > 1 else ""
    lines = [f"plan: {layout.world_size} ranks, {layout_words(layout)}{experts}, image {image_size[0]}x{image_size[1]}"
             f"{batched} (GiB per rank)"]
    for role in roles:
        lines.append(f"  ranks {role.ranks} (tp rank {role.tp_rank}):")
        lines.append("    parameters  " + ", ".join(f"{k} {gib(v)}" for k, v in role.params.items() if v)
                     + f"  = {gib(role.param_bytes)}")
        lines.append("    activations " + ", ".join(f"{k} {gib(v)}" for k, v in role.activations.items())
                     + f"  -> peak {gib(role.activation_bytes)} (KV cache + the largest phase)")
        lines.append(f"    workspace {gib(role.workspace)}   total {gib(role.total())}   "
                     f"reads {gib(role.read_bytes)} from the checkpoint")
        lines += traffic_report(role)
    if device_memory:
        worst = max(r.total() for r in roles)
        budget = device_memory * (1 - headroom)
        lines.append(f"  device memory {gib(device_memory)} GiB, {headroom:.0%} kept free: "
                     f"{'fits' if worst <= budget else 'DOES NOT FIT'} ({gib(worst)} of {gib(budget)})")
    else:
        lines.append("  no device memory given (--device-memory / device_memory): no fit check")
    return "\n".join(lines)


def traffic_report(role) -> list:
    """The rank's traffic lines (utils/planner/traffic.py: what "sent" means per collective)."""
    from utils.planner.traffic import DENOISING_STEP, PHASES, TEXT_DECODE
    out = []
    for phase in PHASES:
        lines = (role.traffic or {DENOISING_STEP: role.comm_per_step}).get(phase, {})
        total = sum(lines.values())
        if phase == DENOISING_STEP or total:
            where = f"sent per {phase}" if phase != "VAE decode" else "sent in the VAE decode"
            unit, scale = ("KiB", 2**10) if phase == TEXT_DECODE else ("MiB", 2**20)     # a token's few KiB
            text = ", ".join(f"{k} {v / scale:.1f}" for k, v in lines.items()) or "nothing"
            out.append(f"    {where}: {total / scale:.1f} {unit} ({text})")
    return out


def design_rows(model_dir, layout, image_size, device_kind: str, quantize=None, conditioning_images=None) -> list:
    """The designs of traffic.PLANNED on this layout's world and CFG split, each with the MoE
    expert-parallel (they are EP designs): [(name, status, MiB sent per denoising step by rank 0,
    per-rank bytes, traffic by purpose)]. Built designs are planned as the code runs them (the
    layout built on the meta device: exact parameters); int8 dispatch as it runs, on NPU with int8
    experts computing W8A8; an unbuilt design (dedup) is its traffic arithmetic and an estimate."""
    from dataclasses import replace
    from adaptor_patches.parallel.layout import LayoutError
    from utils.planner.memory_plan import planned_role_bytes, read_config
    from utils.planner.traffic import DENOISING_STEP, PLANNED, design_layout, for_layout, image_lines, per_step
    config, raw = read_config(model_dir)
    rows, planned_roles = [], {}            # int8 dispatch and dedup plan the same layout and experts: once
    for design in PLANNED:
        design = for_layout(design, layout)
        try:
            planned = design_layout(design, replace(layout, moe="ep"))
            planned.check(raw)
        except LayoutError as exc:
            rows.append((design.name, f"not for this layout ({exc})", None, None, {}))
            continue
        int8 = design.dispatch == "int8"
        kind, experts, compute = ("npu", "int8", "w8a8") if int8 else (device_kind, quantize, None)
        key = (planned, kind, experts, compute)
        if key not in planned_roles:
            planned_roles[key] = plan(model_dir, planned, image_size, kind, experts, compute, conditioning_images)
        roles = planned_roles[key]
        if design.built:
            lines = roles[0].comm_per_step
            memory = max(r.total() for r in roles)
        else:
            lines = per_step(image_lines(config, raw, planned, image_size, 0, design=design, device_kind=kind),
                             DENOISING_STEP)
            memory = max(planned_role_bytes(config, raw, planned, image_size, r, kind, design, experts,
                                            conditioning_images) for r in roles)
        status = ("built" if design.built else "planned, not built") + (" (NPU, int8 experts, W8A8)" if int8 else "")
        rows.append((design.name, status, sum(lines.values()) / 2**20, memory, lines))
    return rows


def planned_report(model_dir, layout, image_size, device_kind: str, quantize=None, conditioning_images=None) -> list:
    """One line per design of traffic.PLANNED (design_rows): bytes per denoising step and per-rank memory."""
    if layout.tp < 2:
        return []
    out = ["  the designs of issue 29 on this world (per rank: sent per denoising step / memory):"]
    for name, status, sent, memory, _ in design_rows(model_dir, layout, image_size, device_kind, quantize,
                                                     conditioning_images):
        out.append(f"    {name}: {status}" if sent is None else
                   f"    {name}: {sent:.1f} MiB, {gib(memory)} GiB, {status}")
    return out


def check_conditioning_images(images, raw: dict) -> None:
    from adaptor_patches.model_family import is_instruct
    from utils.planner.memory_plan import MAX_CONDITIONING_IMAGES
    if images is None:
        return
    if not is_instruct(raw) and images:
        raise PlanError(f"conditioning-images: {images} given, but this is a base checkpoint (text to image only); "
                        f"drop the flag or plan an Instruct checkpoint")
    if not 0 <= images <= MAX_CONDITIONING_IMAGES:
        raise PlanError(f"conditioning-images: {images} is outside 0..{MAX_CONDITIONING_IMAGES}; "
                        f"pass 0 to {MAX_CONDITIONING_IMAGES}")


def conditioning_line(config, raw: dict, images) -> str:
    """What the plan's context holds besides the prompt and the generated image (Instruct checkpoints)."""
    from adaptor_patches.model_family import is_instruct
    from utils.planner.memory_plan import MAX_CONDITIONING_IMAGES, TEXT_TOKENS, conditioning_tokens
    if not is_instruct(raw):
        return f"  context: {TEXT_TOKENS} text tokens + the image's"
    images = MAX_CONDITIONING_IMAGES if images is None else images
    rows = conditioning_tokens(config, raw, images)
    return (f"  context: {TEXT_TOKENS} text tokens + {images} conditioning image(s), {rows} rows "
            f"({rows // images if images else 0} each: VAE latents + SigLIP2 tokens) + the image's")


def layout_words(layout) -> str:
    moe = {"replicated": "MoE whole", "tp": f"MoE TP{layout.tp}", "ep": f"MoE EP{layout.tp}"}[layout.moe_mode]
    cfg = "CFG2 x " if layout.cfg > 1 else ""
    attention = (f"Ulysses {layout.ulysses} x attention TP{layout.attention_tp}" if layout.ulysses > 1
                 else f"attention TP{layout.tp}")
    shares = ", sequence shares" if layout.sequence_sharded else ""
    return f"{cfg}{attention}, {moe}{shares}" + (", VAE parallel" if layout.vae_parallel else "")


def candidate_plans(model_dir, world_size: int, image_size, device_kind: str, quantize=None,
                    conditioning_images=None) -> list:
    """(flags text, worst role total) of every layout of `world_size` ranks this config runs with
    these experts (an int4 group size must divide every rank's expert slices)."""
    from adaptor_patches.weights.int4_format import layout_problem
    config = json.loads((Path(model_dir) / "config.json").read_text())
    out = []
    for flags in FLAG_SETS:
        try:
            layout = layout_from(world_size, flags)
        except ValueError:
            continue
        if layout.problem(config) is None and layout_problem(quantize, layout, config) is None:
            roles = plan(model_dir, layout, image_size, device_kind, quantize, conditioning_images=conditioning_images)
            out.append((" ".join(flags + ("--vae-parallel",)), max(r.total() for r in roles)))
    return out


def layouts_that_fit(model_dir, world_size: int, image_size, device_kind: str, device_memory: int,
                     headroom=HEADROOM, quantize=None, conditioning_images=None) -> list:
    return [flags for flags, total in candidate_plans(model_dir, world_size, image_size, device_kind, quantize,
                                                      conditioning_images)
            if total <= device_memory * (1 - headroom)]


def fewest_cards(model_dir, memory: int, image_size, device_kind: str, quantize=None,
                 world_sizes=(1, 2, 4, 8, 16, 32), conditioning_images=None):
    """(cards, flags) of the smallest world size with a layout that fits `memory`, or None."""
    budget = memory * (1 - HEADROOM)
    for n in world_sizes:
        fits = [f for f, total in candidate_plans(model_dir, n, image_size, device_kind, quantize, conditioning_images)
                if total <= budget]
        if fits:
            return n, fits[0]
    return None


def what_would_fit(model_dir, world_size: int, image_size, device_kind: str, memory: int, quantize=None,
                   conditioning_images=None) -> list:
    """Phrases naming what fits `memory` when no layout of `world_size` ranks does: int4 experts on as
    many ranks, fewer conditioning images (Instruct), the fewest cards of these experts."""
    from adaptor_patches.kernels import int4
    from utils.planner.memory_plan import conditioning_image_count, read_config
    _, raw = read_config(model_dir)
    out = []
    if not int4.is_int4(quantize):
        fits = layouts_that_fit(model_dir, world_size, image_size, device_kind, memory, quantize=int4.BASE,
                                conditioning_images=conditioning_images)
        if fits:
            out.append(f"{world_size} rank(s) with --quantize int4 ({fits[0]})")
    for images in range(conditioning_image_count(raw, conditioning_images) - 1, -1, -1):
        fits = layouts_that_fit(model_dir, world_size, image_size, device_kind, memory, quantize=quantize,
                                conditioning_images=images)
        if fits:
            out.append(f"{world_size} rank(s) with --conditioning-images {images} ({fits[0]})")
            break
    fewest = fewest_cards(model_dir, memory, image_size, device_kind, quantize,
                          world_sizes=tuple(n for n in (1, 2, 4, 8, 16, 32) if n > world_size),
                          conditioning_images=conditioning_images)
    if fewest:
        out.append(f"{fewest[0]} ranks ({fewest[1]})")
    return out


def format_table(model_dir, memories: list, image_size, device_kind: str, quantize, conditioning_images=None) -> str:
    """The fewest cards per expert format (bf16, int8, `quantize`) and `quantize` on one card, per memory."""
    from utils.planner.memory_plan import plan as plan_roles
    formats = list(dict.fromkeys([None, "int8", quantize]))
    one = plan_roles(model_dir, layout_from(1, ()), image_size, device_kind, quantize,
                     conditioning_images=conditioning_images)[0]
    head = " | ".join(f"{experts_words(f) if f else 'bf16'}: fewest cards" for f in formats)
    rows = [f"| device memory ({device_kind}) | {head} | {quantize or 'bf16'} on one card |",
            "|" + "---|" * (len(formats) + 2)]
    for text in memories:
        memory = parse_memory(text)
        cells = []
        for fmt in formats:
            found = fewest_cards(model_dir, memory, image_size, device_kind, fmt, conditioning_images=conditioning_images)
            cells.append(f"{found[0]} (`{found[1]}`)" if found else "more than 32")
        budget = memory * (1 - HEADROOM)
        parts = ", ".join(f"{k} {gib(v)}" for k, v in one.activations.items())
        verdict = "fits" if one.total() <= budget else "does not fit"
        cell = (f"{verdict}: {gib(one.total())} of {gib(budget)} GiB (parameters {gib(one.param_bytes)}, activations "
                f"{gib(one.activation_bytes)}: {parts}; workspace {gib(one.workspace)})")
        if one.total() > budget:
            cell += "; fits: " + (" or ".join(what_would_fit(model_dir, 1, image_size, device_kind, memory, quantize,
                                                              conditioning_images)) or "nothing up to 32 ranks")
        rows.append(f"| {text} | " + " | ".join(cells) + f" | {cell} |")
    return "\n".join(rows)


def fit_table(model_dir, memories: list, image_size, device_kind: str, world_sizes=(1, 2, 4, 8, 16, 32),
              quantize=None) -> str:
    candidates = {n: candidate_plans(model_dir, n, image_size, device_kind, quantize) for n in world_sizes}
    rows = ["| device memory | fewest cards (a layout) | layouts that fit 8 cards | layouts that fit 16 cards |",
            "|---|---|---|---|"]
    for text in memories:
        budget = parse_memory(text) * (1 - HEADROOM)
        found = {n: [f for f, total in candidates[n] if total <= budget] for n in world_sizes}
        fewest = next((f"{n} (`{found[n][0]}`)" for n in world_sizes if found[n]), f"more than {world_sizes[-1]}")
        rows.append(f"| {text} | {fewest} | {'<br>'.join(f'`{f}`' for f in found[8]) or 'none'} | "
                    f"{'<br>'.join(f'`{f}`' for f in found[16]) or 'none'} |")
    return "\n".join(rows)


def check_fit(roles, model_dir, layout, image_size, device_kind: str, device_memory: int, headroom=HEADROOM,
              quantize=None, conditioning_images=None, batch: int = 1, batch_field: str = "batch",
              batch_fix: str = "use --batch {}"):
    """Nothing when the planned `roles` fit; else PlanError naming the role over budget, the
    shortfall and the layouts of the same world size that fit, or else what would (planned only then);
    for a `batch` of requests that does not fit where fewer do, the largest batch that fits, named by
    `batch_field` (the flag or YAML key that set it) with `batch_fix` (formatted with that batch)."""
    over = shortfall(roles, device_memory, headroom)
    if over is None:
        return
    role, needed, budget = over
    if batch > 1:
        from utils.planner.memory_plan import largest_batch
        largest = largest_batch(model_dir, layout, image_size, roles, device_memory, headroom, device_kind, quantize,
                                conditioning_images=conditioning_images, most=batch - 1)
        if largest:
            raise PlanError(f"{batch_field}: {batch} requests per forward batch need {gib(needed)} GiB per rank (ranks "
                            f"{role.ranks}: activations {gib(role.activation_bytes)}) but {gib(budget)} GiB of "
                            f"{gib(device_memory)} are usable, {largest} would fit; {batch_fix.format(largest)}")
    fits = layouts_that_fit(model_dir, layout.world_size, image_size, device_kind, device_memory, headroom, quantize,
                            conditioning_images)
    if fits:
        instead = f"layouts that fit {layout.world_size} ranks: {' | '.join(fits)}"
    else:
        others = what_would_fit(model_dir, layout.world_size, image_size, device_kind, device_memory, quantize,
                                conditioning_images)
        instead = (f"no layout of {layout.world_size} ranks fits; what fits: {' or '.join(others)}" if others else
                   f"no layout of {layout.world_size} ranks fits (int4 experts included), nor one of up to 32 "
                   f"ranks; use devices with more memory")
    raise PlanError(f"device_memory: ranks {role.ranks} need {gib(needed)} GiB (parameters {gib(role.param_bytes)}, "
                    f"activations {gib(role.activation_bytes)}, workspace {gib(role.workspace)}) but "
                    f"{gib(budget)} GiB of {gib(device_memory)} are usable: {gib(needed - budget)} GiB short; "
                    f"{instead}; or pass --no-plan to launch anyway")


def planned_adapters(lora_modules, model_dir) -> tuple:
    """--lora-modules' adapters, read and held against the checkpoint (its headers, or a config folder's
    config.json alone); a bad one is a PlanError naming the flag."""
    if not lora_modules:
        return ()
    from adaptor_patches.weights.lora import LoraError, parse_lora_modules, read_adapter
    try:
        return tuple((name, read_adapter(path)) for name, path in parse_lora_modules(lora_modules))
    except LoraError as exc:
        raise PlanError(f"lora-modules: {exc.problem}; {exc.fix}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m utils.planner", description=__doc__.splitlines()[0])
    p.add_argument("--model-id", required=True, help="a checkpoint or config directory (config.json is read)")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--cfg-parallel", action="store_true")
    p.add_argument("--moe-tp", action="store_true")
    p.add_argument("--moe-ep", action="store_true")
    p.add_argument("--vae-parallel", action="store_true")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses degree within a CFG branch (1: none)")
    p.add_argument("--image-size", default=None, help="HxW (default: the model's base size)")
    p.add_argument("--device", default="npu", choices=BACKEND_KINDS)
    p.add_argument("--device-memory", default=None, help="e.g. 64GiB: check the fit")
    p.add_argument("--fit-table", default=None, help="comma-separated memories: which layouts fit each")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quantize", default="none", choices=("none",) + FORMATS,
                   help="routed experts in 8 bit (1 byte per parameter + float32 scales) or int4 (half a byte + "
                        "a bfloat16 scale per group of 128 input channels; -g32/-g64/-g256 other groups)")
    p.add_argument("--quant-compute", default=None, choices=QUANT_COMPUTES,
                   help="how quantized experts compute (default: weight-only; w8a8 with int8 experts on NPU: "
                        "EP rows sent as int8)")
    p.add_argument("--conditioning-images", type=int, default=None,
                   help="Instruct checkpoints: images per request in the context (default: the most, 3)")
    p.add_argument("--lora-modules", default=None, metavar="NAME=PATH[,NAME=PATH...]",
                   help="LoRA adapters kept beside the weights (run_image_gen's --lora-modules): their bytes per rank")
    p.add_argument("--batch", type=int, default=1,
                   help="requests per forward batch (--max-batch / --batch-size): activations and traffic scale with it")
    args = p.parse_args(argv)
    quantize = None if args.quantize == "none" else args.quantize
    try:
        from adaptor_patches.parallel.layout import Layout, LayoutError
        from utils.planner.memory_plan import read_config
        from adaptor_patches.weights.checkpoint import check_regular_files
        check_regular_files(args.model_id)
        if not (Path(args.model_id) / "config.json").is_file():
            raise PlanError(f"model-id: {args.model_id} has no config.json; pass a checkpoint or config/real_model")
        config, raw = read_config(args.model_id)
        size = parse_size(args.image_size, config)
        check_conditioning_images(args.conditioning_images, raw)
        if args.batch < 1:
            raise PlanError(f"batch: {args.batch} is not a number of requests; pass 1 or more")
        if args.fit_table:
            print(fit_table(args.model_id, args.fit_table.split(","), size, args.device, quantize=quantize))
            if quantize:
                print("\n" + format_table(args.model_id, args.fit_table.split(","), size, args.device, quantize,
                                          args.conditioning_images))
            return 0
        layout = Layout.from_flags(args.world_size, args.cfg_parallel, args.moe_tp, args.moe_ep, args.vae_parallel,
                                   args.ulysses)
        layout.check(raw)
        memory = parse_memory(args.device_memory) if args.device_memory else None
        roles = plan(args.model_id, layout, size, args.device, quantize, args.quant_compute, args.conditioning_images,
                     args.batch, planned_adapters(args.lora_modules, args.model_id))
        print(report(roles, layout, size, memory, quantize=quantize, batch=args.batch))
        print(conditioning_line(config, raw, args.conditioning_images))
        print("\n".join(planned_report(args.model_id, layout, size, args.device, quantize, args.conditioning_images)))
        if args.json:
            args.json.write_text(json.dumps([r.as_json() for r in roles], indent=2))
        if memory:
            check_fit(roles, args.model_id, layout, size, args.device, memory, quantize=quantize,
                      conditioning_images=args.conditioning_images, batch=args.batch)
    except (PlanError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
