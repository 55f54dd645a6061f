"""Every rank's weights, as the loader hands them to the model, are those of commit f0bc74a (issue 27.1).

tests/data/rank_tensor_hashes.json holds, for every split the loader runs x every way in, the hash
of each tensor of each rank's lazy state dict (what transformers' from_pretrained receives), as the
code before weights/ was restructured computed them. This file's `main()` wrote it:

    .venv/bin/python tests/test_rank_tensors_unchanged.py --write tests/data/rank_tensor_hashes.json

Ways in (`SOURCES`): the original checkpoint loaded as bf16, with --quantize int8 and with
--quantize fp8; our converted folder of the split (bf16, also quantized at load; --int8; --fp8);
the cann-recipes folder of the split (bf16, also quantized at load; --int8). Splits (`SPLITS`):
one process, attention TP 2 and 4 with the MoE replicated, tensor parallel or expert parallel,
and CFG 2 x TP 2 (every global rank; the CFG branches read the same tensors).

The checkpoint is the tiny model's tree (utils/make_tiny_model.py: names, shapes, shards) with
every tensor's values rewritten from integer arithmetic on its name (`deterministic_values`), so it
is the same bytes on any machine, torch build or seed: RNG output may differ between CPU builds,
integers do not. Quantizing (per-channel amax, a division, a rounding) is exactly rounded IEEE
arithmetic, the same on any build too.
"""
import contextlib
import hashlib
import io
import json
import shutil
import sys
import zlib
from pathlib import Path

if __name__ == "__main__":      # run by path (--write): the repo root, for its packages (tests/ is there already)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaptor_patches.parallel.layout import Layout

REFERENCE = Path(__file__).parent / "data" / "rank_tensor_hashes.json"
SPLITS = {"single": Layout(1), "tp2-moe-replicated": Layout(2, 1, "replicated"), "tp2-moe-tp": Layout(2, 1, "tp"),
          "tp2-moe-ep": Layout(2, 1, "ep"), "tp4-moe-replicated": Layout(4, 1, "replicated"),
          "tp4-moe-tp": Layout(4, 1, "tp"), "tp4-moe-ep": Layout(4, 1, "ep"), "cfg2-tp2-moe-ep": Layout(4, 2, "ep")}
# (source, --quantize, the folder's conversion flags)
SOURCES = (("original", None, None), ("original", "int8", None), ("original", "fp8", None),
           ("converted", None, ()), ("converted", "int8", ()), ("converted", "fp8", ()),
           ("converted", None, ("--int8",)), ("converted", None, ("--fp8",)),
           ("recipe", None, ()), ("recipe", "int8", ()), ("recipe", "fp8", ()), ("recipe", None, ("--int8",)))


def deterministic_values(name: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Non-zero values of magnitude 2^-10 .. 2^-3, both signs, from the element index and the name's
    CRC through two rounds of arithmetic modulo the prime 2^31 - 1 (every product fits an int64
    exactly), so no two slices of a tensor repeat each other."""
    prime = (1 << 31) - 1
    i = torch.arange(torch.Size(shape).numel(), dtype=torch.int64)
    x = (i * 48271 + zlib.crc32(name.encode())) % prime
    x = (x * x + 12345) % prime
    sign, exponent, mantissa = x & 1, 117 + (x >> 1) % 8, (x >> 4) % 128
    bits = (sign << 15) | (exponent << 7) | mantissa                # bfloat16's bit layout
    bits = bits - (bits >= 1 << 15).to(torch.int64) * (1 << 16)     # as int16, exactly
    return bits.to(torch.int16).view(torch.bfloat16).reshape(shape).to(dtype)


def make_checkpoint(out: Path) -> Path:
    """The tiny model's files with every tensor's values from `deterministic_values`."""
    import model_adaptor
    from utils.make_tiny_model import make_tiny_model
    if model_adaptor.is_applied():      # upstream's own module tree names the tensors, not the patched one
        model_adaptor.remove()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        make_tiny_model(out)
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(shard))
        save_file({k: deterministic_values(k, v.shape, v.dtype) for k, v in tensors.items()}, str(shard),
                  metadata={"format": "pt"})
    return out


def split_folder(source: str, flags: tuple, layout: Layout, original: Path, root: Path) -> Path:
    """Our converted folder or the recipe's for `layout`'s weight split, made once."""
    weights = layout.weights
    degrees = (weights.tp, weights.tp_moe, weights.ep)
    out = root / f"{source}{''.join(flags)}-{'-'.join(map(str, degrees))}"
    if out.is_dir():
        return out
    if source == "recipe":
        from recipe_checkpoint import make_recipe_checkpoint
        return make_recipe_checkpoint(original, out, *degrees, int8="--int8" in flags)
    from utils import convert_model
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = convert_model.main(["--model-path", str(original), "--output-path", str(out), "--tp-attn",
                                   str(degrees[0]), "--tp-moe", str(degrees[1]), "--ep", str(degrees[2]), *flags])
    assert code == 0, f"converting {out.name} failed"
    return out


def handed_to_model(model_dir: Path, layout: Layout, rank: int, quantize) -> dict:
    """{name: tensor} that rank `rank`'s loader gives transformers' from_pretrained (its lazy state
    dict, every value read), for a text-to-image job as run_image_gen.py makes it."""
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.checkpoint import open_checkpoint
    from adaptor_patches.weights.load import lazy_state_dict
    checkpoint = open_checkpoint(model_dir)
    expert_format = checkpoint.check_for_run(layout, rank, quantize=quantize)
    lazy = lazy_state_dict(checkpoint, RankContext(layout, rank, text_to_image_only=True, expert_format=expert_format))[0]
    return {name: value[...] for name, value in lazy.items()}


def entry(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} {hashlib.sha256(data).hexdigest()[:16]}"


def digest(plan: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(plan.items())).encode()).hexdigest()[:16]


def case_name(source, quantize, flags, split, rank) -> str:
    held = flags[0].removeprefix("--") + "-folder" if flags else "bf16"
    return f"{source}/{held}/{quantize or 'as-stored'}/{split}/rank{rank}"


def split_hashes(split: str, original: Path, root: Path) -> dict:
    """{case name: {tensor name: entry}} of every way in and every global rank of one split."""
    layout = SPLITS[split]
    found = {}
    for source, quantize, flags in SOURCES:
        model_dir = original if source == "original" else split_folder(source, flags, layout, original, root)
        for rank in range(layout.world_size):
            tensors = handed_to_model(model_dir, layout, rank, quantize)
            found[case_name(source, quantize, flags, split, rank)] = {k: entry(v) for k, v in tensors.items()}
    return found


def as_reference(original: Path, found: dict) -> dict:
    """The stored form: each checkpoint tensor's entry once; per distinct rank plan only the entries
    that differ from the stored tensor of that name; per case its plan's digest."""
    stored = {}
    for shard in sorted(original.glob("*.safetensors")):
        stored.update({k: entry(v) for k, v in load_file(str(shard)).items()})
    plans, cases = {}, {}
    for name, plan in found.items():
        key = digest(plan)
        cases[name] = key
        plans[key] = {"changed": {k: v for k, v in sorted(plan.items()) if stored.get(k) != v},
                      "unchanged": sum(stored.get(k) == v for k, v in plan.items())}
    return {"about": "tests/test_rank_tensors_unchanged.py: each rank's tensors as the loader hands them to the "
                     "model; entries are 'dtype [shape] sha256[:16]' of the tensor's bytes",
            "commit": "f0bc74a", "stored": stored, "plans": plans, "cases": cases}


def differences(reference: dict, found: dict) -> list:
    """One line per case whose tensors differ from the reference, naming the first tensors that do."""
    lines = []
    for name, plan in found.items():
        key = reference["cases"].get(name)
        if key is None:
            lines.append(f"{name}: not in the reference")
            continue
        if digest(plan) == key:
            continue
        expected = reference["plans"][key]
        changed = [k for k, v in plan.items() if v != expected["changed"].get(k, reference["stored"].get(k))]
        missing = sorted(set(expected["changed"]) - set(plan))
        unchanged = sum(reference["stored"].get(k) == v for k, v in plan.items())
        lines.append(f"{name}: differs in {changed[:3]}, lacks {missing[:3]}, "
                     f"{unchanged} tensors as stored (expected {expected['unchanged']})")
    return lines


def test_the_values_repeat_nowhere():
    """No two rows of a tensor hold the same values, so a shifted or swapped cut changes its hash
    (values made from a few low bits of the index once repeated every 2048 elements)."""
    rows = deterministic_values("model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight", (256, 128), torch.bfloat16)
    assert len(torch.unique(rows.view(torch.int16), dim=0)) == 256 and bool((rows != 0).all())


@pytest.fixture(scope="module")
def hashed_checkpoint(tmp_path_factory):
    """(the checkpoint, a folder for its conversions, the entries of its stored tensors)."""
    root = tmp_path_factory.mktemp("hashed")
    original = make_checkpoint(root / "tiny")
    return original, root, as_reference(original, {})["stored"]


@pytest.mark.slow
@pytest.mark.parametrize("split", list(SPLITS))
def test_every_rank_gets_the_same_tensors_as_before(hashed_checkpoint, split):
    original, root, stored = hashed_checkpoint
    reference = json.loads(REFERENCE.read_text())
    assert stored == reference["stored"], "the deterministic checkpoint itself changed"
    found = split_hashes(split, original, root)
    expected = {name for name in reference["cases"] if name.split("/")[3] == split}
    assert set(found) == expected, set(found) ^ expected
    problems = differences(reference, found)
    assert not problems, f"{len(problems)} of {len(found)} rank cases changed:\n" + "\n".join(problems[:10])


def main(argv):
    if argv[:1] != ["--write"] or len(argv) != 2:
        print("usage: tests/test_rank_tensors_unchanged.py --write tests/data/rank_tensor_hashes.json")
        return 2
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="rank_hashes_"))
    try:
        original = make_checkpoint(root / "tiny")
        found = {}
        for split in SPLITS:
            found.update(split_hashes(split, original, root))
        reference = as_reference(original, found)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(argv[1]).write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {argv[1]}: {len(reference['cases'])} rank cases, {len(reference['plans'])} distinct plans")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
