"""Each image of a batch equals the same request made alone, on one process and on every layout family.

A prompts file (`--prompts FILE`) runs with `--batch-size 1` on one process: every line alone, the
reference. The same file with `--batch-size 4` then makes its compatible lines together (one
forward batch per generated size: utils/runtime/requests/batching.py, adaptor_patches/image_batch.py), on one
process and on the session's rank pools (harness/multirank.py): attention TP, CFG parallel, MoE EP on
sequence shares with VAE parallel, Ulysses with MoE TP on shares. Each line's image must stay
within PSNR_MIN_DB of its alone image (test_layouts.py's bound: the layouts themselves sit at
50-55 dB from one process on this checkpoint), its think text and ratio equal. Every other line's alone image must be
far (under APART_MAX_DB): a batch that swapped two requests' seeds, prompts or images fails.

The base model's file (conftest's gained checkpoint with the text phase's LM head, text_checkpoint.py):
  three lines at 64x64 (prompts of different lengths: right-padded rows), one of them with a think
  text, made as one batch (on one process and on every layout); on one process also two `auto`
  lines with think texts, whose ratio tokens choose their sizes (a forward batch per size), and two
  lines under a taylor step cache (one schedule for the batch).
The Instruct model: two edits with different conditioning images (96x80 and 64x64: different
token counts per row), one batch under CFG parallel. Instruct-Distil (one branch, one guidance value
per row): two lines under attention TP.
Measured (these checkpoints and seeds; each line's PSNR to its alone image): one process 50.5-51.9 dB
for the three, 48.0 / 54.1 for the `auto` pair (it chose one size: one forward), 52.6 dB and
bit-equal for the taylor pair; TP2 49.5-51.5, CFG2 50.7-53.1, MoE EP2 x CFG2 + VAE parallel
49.3-51.6, Ulysses 2 x TP2 + MoE TP 49.7-50.9 dB; Instruct edits under CFG2 55.0 / 93.3 dB; Distil
under TP2 54.2 / 54.4 dB; every other line's alone image 13-15 dB away. Broken on purpose, the
bound caught it: the seeds reversed inside the batch (one process: 14.0 dB), each row's conditioning
latent drawn from the first request's generator as upstream does (Instruct edits: 14.8 dB).
"""
import json

import pytest

from generation import psnr, run_cli_in_process, run_in_pool
from harness.checkpoints import make_text_checkpoint
from harness.multirank import run_apart
from test_instruct_jobs import write_inputs

pytestmark = pytest.mark.slow
PSNR_MIN_DB = 40.0
APART_MAX_DB = 30.0
TAYLOR = {"mode": "taylor", "warmup": 1, "interval": 2}
BASE_LINES = [
    {"prompt": "a red fox standing in fresh snow", "seed": 7},
    {"prompt": "a lighthouse at dusk on a rocky coast, waves breaking hard against the black rocks", "seed": 8,
     "bot_task": "think"},
    {"prompt": "ramen", "seed": 9},
    {"prompt": "a cat on a windowsill", "seed": 10, "bot_task": "think", "image_size": "auto"},
    {"prompt": "an old steam train crossing a bridge", "seed": 11, "bot_task": "think", "image_size": "auto"},
    {"prompt": "a field of sunflowers", "seed": 12, "step_cache": TAYLOR, "diff_infer_steps": 4},
    {"prompt": "a mountain lake at noon", "seed": 13, "step_cache": TAYLOR, "diff_infer_steps": 4},
]
FIXED = (0, 1, 2)                    # the base lines of one forward batch
BASE_LAYOUTS = {                     # name: (ranks, flags), one per layout family
    "tp2": (2, []),
    "cfg2": (2, ["--cfg-parallel"]),
    "ep2_cfg2_moe_ep_vae": (4, ["--cfg-parallel", "--moe-ep", "--vae-parallel"]),
    "u2_tp2_moe_tp": (4, ["--moe-tp", "--ulysses", "2"]),
}


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def prompts_job(model, lines_file, out, batch_size, *extra):
    return ["--prompts", lines_file, "--model-id", model, "--device", "cpu", "--save-dir", out, "--batch-size",
            batch_size, *map(str, extra)]


def records(out) -> list:
    """metrics.jsonl's image lines, in the file's line order."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    images = [line for line in lines if "label" in line]
    return sorted(images, key=lambda r: int(r["label"].split()[1]))


def compare(batched_out, alone_out, what: str, fixed=None) -> list:
    """Per line: (PSNR to its alone image, the batch it ran in); asserts the bounds, the texts and
    sizes equal, and that every other line's alone image is far from it (a swap would fail)."""
    batched, alone = records(batched_out), records(alone_out)[:len(records(batched_out))]
    assert [r["status"] for r in batched] == ["ok"] * len(alone), batched
    out = []
    for i, (b, a) in enumerate(zip(batched, alone)):
        db = psnr(b["save"], a["save"])
        out.append((round(float(db), 1), b["batch_size"]))
        assert db >= PSNR_MIN_DB, f"{what}: {b['label']} is {db:.1f} dB from the same request alone"
        assert b["size"] == a["size"] and b["text_tokens"] == a["text_tokens"], (what, b, a)
        text = a["save"].rsplit(".", 1)[0] + ".txt"
        if a.get("bot_task") == "think":
            assert open(text).read() == open(b["save"].rsplit(".", 1)[0] + ".txt").read(), (what, b["label"])
        for j, other in enumerate(alone):
            if j != i and other["size"] == b["size"] and (fixed is None or j in fixed):
                apart = psnr(b["save"], other["save"])
                assert apart < APART_MAX_DB, f"{what}: {b['label']} is {apart:.1f} dB from {other['label']} alone"
    print(what, out)
    return out


@pytest.fixture(scope="module")
def base(gained_model, tmp_path_factory):
    """{name: save dir} of the base model's lines: alone, batched on one process and on every layout."""
    tmp = tmp_path_factory.mktemp("batches")
    model = make_text_checkpoint(gained_model, tmp / "text_model")
    lines = write_lines(tmp / "lines.jsonl", BASE_LINES)
    fixed = write_lines(tmp / "fixed.jsonl", [BASE_LINES[i] for i in FIXED])          # the layouts' lines
    common = ["--diff-infer-steps", 2, "--image-size", "64x64", "--max-new-tokens", 6]
    outs = {"alone": tmp / "alone", "one process": tmp / "one"}
    for name, batch in (("alone", 1), ("one process", 4)):
        proc = run_cli_in_process(prompts_job(model, lines, outs[name], batch, *common))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    by_ranks = {}
    for name, (ranks, flags) in BASE_LAYOUTS.items():
        outs[name] = tmp / name
        by_ranks.setdefault(ranks, []).append(prompts_job(model, fixed, outs[name], 4, *common, *flags))
    for ranks, jobs in sorted(by_ranks.items()):
        run_in_pool(ranks, jobs)
    return outs


def test_a_batch_on_one_process_equals_each_request_alone(base):
    result = compare(base["one process"], base["alone"], "one process", FIXED)
    assert [size for _, size in result[:3]] == [3, 3, 3]              # the three 64x64 lines: one forward
    assert [size for _, size in result[5:]] == [2, 2]                 # the taylor pair: one forward, one schedule
    sizes = [r["size"] for r in records(base["one process"])[3:5]]
    assert [size for _, size in result[3:5]] == ([2, 2] if sizes[0] == sizes[1] else [1, 1]), sizes
    cached = [r["step_cache"]["cached_steps"] for r in records(base["one process"])[5:]]
    assert cached[0] == cached[1] and cached[0], cached


@pytest.mark.parametrize("layout", list(BASE_LAYOUTS))
def test_a_batch_on_a_layout_equals_each_request_alone(base, layout):
    result = compare(base[layout], base["alone"], layout, FIXED)
    assert [size for _, size in result[:3]] == [3, 3, 3]


@pytest.fixture(scope="module")
def instruct(tiny_instruct, tiny_distil, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("instruct_batches")
    write_inputs(tmp, 0)                                  # a.png 96x80, b.png 64x64
    edits = write_lines(tmp / "edits.jsonl", [
        {"prompt": "make the fox blue", "seed": 5, "image": ["a.png"]},
        {"prompt": "a red lighthouse in the same style as this picture", "seed": 6, "image": ["b.png"]}])
    texts = write_lines(tmp / "texts.jsonl", [{"prompt": "a red fox", "seed": 5},
                                              {"prompt": "a lighthouse at dusk on a rocky coast", "seed": 6}])
    common = ["--diff-infer-steps", 2, "--image-size", "256x256", "--bot-task", "image"]
    outs, alone, pool = {}, [], []
    for name, model, lines, batch, ranks, flags in (
            ("edits alone", tiny_instruct, edits, 1, 1, []), ("edits cfg2", tiny_instruct, edits, 2, 2, ["--cfg-parallel"]),
            ("distil alone", tiny_distil, texts, 1, 1, []), ("distil tp2", tiny_distil, texts, 2, 2, [])):
        outs[name] = tmp / name.replace(" ", "_")
        (alone if ranks == 1 else pool).append(prompts_job(model, lines, outs[name], batch, *common, *flags))
    for proc in run_apart([(run_cli_in_process, job) for job in alone]):      # one process each, side by side
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_in_pool(2, pool)
    return outs


def test_instruct_edits_in_a_batch_each_keep_their_own_images(instruct):
    result = compare(instruct["edits cfg2"], instruct["edits alone"], "Instruct edits, CFG parallel")
    assert [size for _, size in result] == [2, 2]


def test_distil_requests_in_a_batch_equal_each_alone(instruct):
    result = compare(instruct["distil tp2"], instruct["distil alone"], "Instruct-Distil, attention TP")
    assert [size for _, size in result] == [2, 2]
