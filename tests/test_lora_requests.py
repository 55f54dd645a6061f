"""--lora-modules: adapters kept beside the weights, chosen per request, mixed in one batch.

The reference of each request is the image its adapter gives merged at load (`--lora`, itself held
to peft's merge_and_unload() under upstream eager by tests/test_lora.py): a prompts file whose lines
choose adapter a, adapter b and the base, decoded as ONE forward batch (--batch-size 3), must give
each line the image it gets alone (>= 40 dB), on one process and on layouts that cut the adapters'
halves (attention TP with MoE TP: qkv rows / o_proj columns / the shared MLP's slices; MoE EP on
sequence shares: rows gathered into qkv_proj, partial sums reduce-scattered; Ulysses 2: heads by
all-to-all, every row's q / k / v projected on its own rank; CFG parallel: each branch's rows). A base line gets the base's image (a batch of three is not bit for bit a batch of one).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from generation import PROMPT, generate, psnr, run_cli_in_process, run_in_pool
from lora_adapters import make_adapter

PSNR_MIN_DB = 40.0
TARGETS = {"a": ["qkv_proj", "o_proj"], "b": ["qkv_proj", "o_proj", "shared_mlp.gate_and_up_proj",
                                              "shared_mlp.down_proj"]}

pytestmark = pytest.mark.usefixtures("unpatched_upstream")


@pytest.fixture(scope="module")
def served(gained_model, tmp_path_factory) -> dict:
    """{name: adapter folder} made by peft on the gained tiny checkpoint."""
    root = tmp_path_factory.mktemp("lora_served")
    made = {}
    for seed, (name, targets) in enumerate(TARGETS.items(), start=3):
        (root / name).mkdir()
        made[name] = make_adapter(gained_model, root / name, targets, seed=seed)[0]
    return made


@pytest.fixture(scope="module")
def alone(served, gained_model, tmp_path_factory) -> dict:
    """Each request's image alone: the adapter merged at load (--lora), and the base."""
    out = tmp_path_factory.mktemp("lora_alone")
    images = {name: generate(gained_model, out, name, "--lora", folder)[0] for name, folder in served.items()}
    images["base"] = generate(gained_model, out, "base")[0]
    return images


def modules_flag(served: dict) -> str:
    return ",".join(f"{name}={folder}" for name, folder in served.items())


def mixed_job(model, served, out: Path, *extra) -> tuple:
    """(run_image_gen arguments, {line's choice: its png}) of one prompts file: served's two adapters (the
    first by the line's `lora`, the second by `adapter`), the base."""
    out.mkdir(parents=True, exist_ok=True)
    first, second = served
    lines = [{"prompt": PROMPT, "lora": first, "save": f"{first}.png"},
             {"prompt": PROMPT, "adapter": second, "save": f"{second}.png"}, {"prompt": PROMPT, "save": "base.png"}]
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--prompts", prompts, "--save-dir", out, "--model-id", model, "--device", "cpu", "--seed", 7,
            "--diff-infer-steps", 3, "--image-size", "64x64", "--batch-size", 3, "--lora-modules", modules_flag(served),
            *extra]
    return [str(a) for a in args], {name: out / f"{name}.png" for name in (first, second, "base")}


def check_each_as_alone(pngs: dict, alone: dict, label: str) -> None:
    for name, png in pngs.items():
        same, base = psnr(png, alone[name]), psnr(png, alone["base"])
        print(f"{label} {name}: {same:.1f} dB vs alone, {base:.1f} dB vs the base")
        assert same >= PSNR_MIN_DB, (label, name, same)
        if name != "base":
            assert base < PSNR_MIN_DB - 10, (label, name, base)


@pytest.mark.slow
def test_mixed_batch_gives_each_request_its_image_alone(served, alone, gained_model, tmp_path):
    args, pngs = mixed_job(gained_model, served, tmp_path / "mixed")
    proc = run_cli_in_process(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lora: 2 adapters chosen per request (a: 4 targets, scale 2, b: 8 targets, scale 2)" in proc.stdout, \
        proc.stdout[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("batch_size") for line in lines[:3]] == [3, 3, 3], lines      # one forward batch
    assert [line.get("adapter") for line in lines[:3]] == ["a", "b", None], lines
    check_each_as_alone(pngs, alone, "1 process")


@pytest.mark.slow
def test_per_request_matches_merged_with_a_scale(served, gained_model, tmp_path):
    """--adapter b --lora-scale 0.5 (per request) against --lora b:0.5 (merged)."""
    merged = generate(gained_model, tmp_path, "merged", "--lora", f"{served['b']}:0.5")[0]
    chosen = generate(gained_model, tmp_path, "chosen", "--lora-modules", modules_flag(served), "--adapter", "b",
                      "--lora-scale", "0.5")[0]
    db = psnr(chosen, merged)
    print(f"per request vs merged at scale 0.5: {db:.1f} dB")
    assert db >= PSNR_MIN_DB, db


@pytest.mark.slow
def test_mixed_batch_on_two_ranks(served, alone, gained_model, tmp_path):
    """Also a converted TP2 folder (utils/convert_model.py): the adapters are held against its
    config.json's shapes and cut for the run's layout."""
    import contextlib
    import io
    from utils import convert_model
    converted = tmp_path / "tp2"
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_model.main([str(a) for a in ("--model-path", gained_model, "--output-path", converted,
                                                    "--tp-attn", 2, "--tp-moe", 2)]) == 0
    jobs = {}
    for layout in (("--moe-tp",), ("--moe-ep",), ("--cfg-parallel",), ("--ulysses", "2")):
        label = "-".join(layout)[2:]
        jobs[label] = mixed_job(gained_model, served, tmp_path / label, *layout)
    jobs["converted-tp2"] = mixed_job(converted, served, tmp_path / "converted", "--moe-tp")
    results = run_in_pool(2, [args for args, _ in jobs.values()])
    for (label, (_, pngs)), proc in zip(jobs.items(), results):
        assert ("cfg=2" if label == "cfg-parallel" else "tp=2") in proc.stdout, proc.stdout[-2000:]
        check_each_as_alone(pngs, alone, label)


@pytest.mark.slow
def test_served_adapters_by_model_name_in_one_batch(served, alone, gained_model, tmp_path):
    """The OpenAI client (one client object): /v1/models lists the adapters; three concurrent requests
    naming adapter a, adapter b and the base model make ONE forward batch, each its image alone."""
    import base64
    import concurrent.futures
    import io
    import urllib.request
    from openai import BadRequestError, OpenAI
    from PIL import Image
    from http_client import metric, serving
    flags = ["--model-id", gained_model, "--device", "cpu", "--lora-modules", modules_flag(served), "--max-batch", 3,
             "--batch-wait-ms", 4000]
    with serving(flags, tmp_path / "server.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=600, max_retries=0)
        listed = {m.id: getattr(m, "parent", None) for m in client.models.list()}
        assert listed == {gained_model.name: None, "a": gained_model.name, "b": gained_model.name}, listed
        with pytest.raises(BadRequestError, match="'c' is not served here"):
            client.images.generate(model="c", prompt=PROMPT)
        names = {"a": "a", "b": "b", "base": gained_model.name}

        def ask(name):
            answer = client.images.generate(model=names[name], prompt=PROMPT, size="64x64",
                                            extra_body={"seed": 7, "steps": 3})
            return Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            images = dict(zip(names, pool.map(ask, names)))
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        assert metric(text, "hunyuan_largest_batch") == 3, text[-2000:]
        page_png, choices = adapter_on_the_page(url, "b", tmp_path)
        assert choices == ["", "a", "b"], choices
    pngs = {}
    for name, image in images.items():
        pngs[name] = tmp_path / f"served_{name}.png"
        image.save(pngs[name])
    check_each_as_alone(pngs, alone, "served")
    (tmp_path / "page_b.png").write_bytes(page_png)
    check_each_as_alone({"b": tmp_path / "page_b.png"}, alone, "the page")


def adapter_on_the_page(url, adapter, out) -> tuple:
    """The page in a headless chromium: adapter chosen in its select, the alone images' settings,
    Generate; (the PNG it shows, the select's option values)."""
    import base64
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from browser import chromium, wait_for
    with chromium(out / "chromium-profile") as browser:
        find = lambda element_id: browser.find_element(By.ID, element_id)    # noqa: E731
        browser.get(url + "/")
        wait_for(browser, lambda: find("app").is_displayed() and find("adapter-field").is_displayed(), what="the form")
        choices = [o.get_attribute("value") for o in Select(find("adapter")).options]
        Select(find("adapter")).select_by_value(adapter)
        find("prompt").send_keys(PROMPT)
        Select(find("size")).select_by_value("64x64")
        for field, value in (("steps", "3"), ("seed", "7")):
            find(field).clear()
            find(field).send_keys(value)
        find("generate").click()
        wait_for(browser, lambda: find("status-text").text.startswith("Done"), 300, "the image")
        return base64.b64decode(find("result-image").get_attribute("src").split(",", 1)[1]), choices


@pytest.mark.slow
def test_instruct_think_text_per_request(tiny_instruct, tmp_path, monkeypatch):
    """The Instruct model's think_recaption with adapters chosen per line, in one job: each line's text
    is the one its adapter writes alone, exactly (the text phase runs one call per adapter chosen: the
    two lines of a together, the base apart; the system prompt's KV a line leaves is reused only by a
    line of the same adapter), and its image is the alone one's (>= 40 dB), and the merged adapter's
    (>= 40 dB, the same text)."""
    from adaptor_patches import image_batch
    calls, text_stage = [], image_batch.text_stage

    def counted(model, requests, *args, **kwargs):
        calls.append(len(requests))
        return text_stage(model, requests, *args, **kwargs)
    monkeypatch.setattr(image_batch, "text_stage", counted)
    (tmp_path / "a").mkdir()        # the trainer's option: attention, the shared MLP and every routed expert
    adapter = make_adapter(tiny_instruct, tmp_path / "a", ["qkv_proj", "o_proj", "gate_and_up_proj", "down_proj"],
                           seed=5)[0]
    common = ["--model-id", tiny_instruct, "--device", "cpu", "--seed", 7, "--diff-infer-steps", 3, "--image-size",
              "64x64", "--bot-task", "think_recaption", "--max-new-tokens", 24]
    served = ["--lora-modules", f"a={adapter}"]
    refs = {}
    for name, extra in (("a", [*served, "--adapter", "a"]), ("base", served), ("merged", ["--lora", adapter])):
        png = tmp_path / f"alone_{name}.png"
        proc = run_cli_in_process([str(a) for a in ["--prompt", PROMPT, "--save", png, "--save-text",
                                                     png.with_suffix(".txt"), *common, *extra]])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        refs[name] = png
    out = tmp_path / "mixed"
    out.mkdir()
    prompts = out / "prompts.jsonl"
    lines = [{"prompt": PROMPT, "lora": "a", "save": "a.png"}, {"prompt": PROMPT, "save": "base.png"},
             {"prompt": PROMPT, "lora": "a", "save": "a2.png"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    calls.clear()
    proc = run_cli_in_process([str(a) for a in ["--prompts", prompts, "--save-dir", out, "--batch-size", 3,
                                                *served, *common]])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(calls) == [1, 2], calls                       # a with a2, the base apart
    for made, name in (("a", "a"), ("base", "base"), ("a2", "a")):
        text, alone_text = (out / f"{made}.txt").read_text(), refs[name].with_suffix(".txt").read_text()
        assert text == alone_text, (made, text, alone_text)
        db = psnr(out / f"{made}.png", refs[name])
        print(f"instruct {made}: {db:.1f} dB vs {name} alone, the same text ({len(text)} characters)")
        assert db >= PSNR_MIN_DB, (made, db)
    assert refs["a"].with_suffix(".txt").read_text() != refs["base"].with_suffix(".txt").read_text()
    merged = psnr(refs["a"], refs["merged"])
    print(f"instruct a per request vs merged: {merged:.1f} dB")
    assert merged >= PSNR_MIN_DB, merged
    # the decode steps too: the experts' adapters in the one-token forwards (not the fixed-shape form)
    assert refs["a"].with_suffix(".txt").read_text() == refs["merged"].with_suffix(".txt").read_text()


@pytest.mark.slow
def test_adapters_of_the_routed_experts_per_request(served, alone, gained_model, tmp_path):
    """The trainer's option (gate_and_up_proj, down_proj: the shared MLP and every routed expert) with
    attention, per request: a batch mixing it, adapter a and the base gives each line its image alone
    (the adapter merged at load) on one process, MoE EP2 on sequence shares (each row's adapter goes to
    its experts' rank with it) and MoE TP2 (the experts' intermediate slices); int4 experts within the
    int4 bound of it. At a quarter of its scale: peft's random halves (init_lora_weights=False) at full
    scale make the gained MoE's output 4x the base's, where the per-request delta's bf16 rounding (1.5
    ulp at the layer, as the merged weights' own) grows to 35 dB over the image; at 0.25 the adapter
    still moves the image to ~20 dB from the base's, and per request is ~50 dB from merged."""
    (tmp_path / "e").mkdir()
    every = f"{make_adapter(gained_model, tmp_path / 'e', ['qkv_proj', 'gate_and_up_proj', 'down_proj'], seed=11)[0]}:0.25"
    refs = dict(alone, e=generate(gained_model, tmp_path, "e_alone", "--lora", every)[0])
    adapters = {"e": every, "a": served["a"]}
    jobs = {"1 process": mixed_job(gained_model, adapters, tmp_path / "one")}
    for layout in (("--moe-ep",), ("--moe-tp",)):
        jobs[layout[0][2:]] = mixed_job(gained_model, adapters, tmp_path / layout[0][2:], *layout)
    proc = run_cli_in_process(jobs["1 process"][0])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = run_in_pool(2, [args for args, _ in list(jobs.values())[1:]])
    for (label, (_, pngs)), proc in zip(jobs.items(), [proc, *results]):
        assert label == "1 process" or "tp=2" in proc.stdout, proc.stdout[-2000:]
        check_each_as_alone(pngs, refs, label)
    int4 = generate(gained_model, tmp_path, "e_int4", "--quantize", "int4", "--lora-modules",
                    f"e={every}", "--adapter", "e")[0]
    db = psnr(int4, refs["e"])
    print(f"int4 experts, e per request vs bf16 merged: {db:.1f} dB")
    assert db >= PSNR_MIN_DB, db


@pytest.mark.slow
def test_int4_experts_with_adapters(served, alone, gained_model, tmp_path):
    """--quantize int4: the adapter (attention and the shared MLP, bf16) beside int4 routed experts,
    merged at load and chosen per request; each within the int4 bound of the bf16 merged image
    (tests/test_int4.py: 40 dB) and the two within 40 dB of each other."""
    merged = generate(gained_model, tmp_path, "merged_int4", "--quantize", "int4", "--lora", served["b"])[0]
    chosen = generate(gained_model, tmp_path, "chosen_int4", "--quantize", "int4", "--lora-modules",
                      modules_flag(served), "--adapter", "b")[0]
    rows = {"per request vs merged (int4)": psnr(chosen, merged), "merged int4 vs bf16": psnr(merged, alone["b"]),
            "per request int4 vs bf16 merged": psnr(chosen, alone["b"]), "vs the base": psnr(chosen, alone["base"])}
    print("; ".join(f"{k}: {v:.1f} dB" for k, v in rows.items()))
    assert min(list(rows.values())[:3]) >= PSNR_MIN_DB and rows["vs the base"] < PSNR_MIN_DB - 10, rows


def _refusal_cases(served: dict, tmp: Path) -> dict:
    a, b = served["a"], served["b"]
    return {
        "not-name-path": (["--lora-modules", str(a)], f"error: lora-modules: --lora-modules '{a}' is not "
                          f"NAME=PATH[:SCALE]; e.g. --lora-modules ink=adapters/ink:0.8"),
        "bad-name": (["--lora-modules", f"a b={a}"], "error: lora-modules: --lora-modules name 'a b' is not 1-64 "
                     "letters, digits, '.', '_' or '-' (starting with a letter or digit); rename it, e.g. ink-v2"),
        "twice": (["--lora-modules", f"a={a},a={b}"], "error: lora-modules: --lora-modules names 'a' twice; give each "
                  "adapter its own name"),
        "missing-folder": (["--lora-modules", f"a={tmp / 'nowhere'}"], f"error: lora-modules: {tmp / 'nowhere'} is "
                           f"not a folder; pass a PEFT adapter folder"),
        "with-lora": (["--lora-modules", f"a={a}", "--lora", str(b)], "error: lora-modules: given with --lora (one "
                      "adapter merged into the weights); serve the merged adapter as one of --lora-modules too, or "
                      "drop --lora"),
        "unknown-adapter": (["--lora-modules", f"a={a}", "--adapter", "c"], "error: adapter: 'c' is not an adapter of "
                            "this job; use one of a"),
        "adapter-without-modules": (["--adapter", "a"], "error: adapter: 'a' is not an adapter of this job; use an "
                                    "adapter given with --lora-modules NAME=PATH"),
        "scale-without-adapter": (["--lora-modules", f"a={a}", "--lora-scale", "0.5"], "error: lora-scale: given "
                                  "without --adapter; choose an adapter with --adapter, or leave it out"),
        "shims": (["--lora-modules", f"a={a}", "--adaptor", "shims"], "error: lora-modules: kept beside the weights by "
                  "the adaptor, which --adaptor shims does not take; use --adaptor full"),
    }


REFUSED = ["not-name-path", "bad-name", "twice", "missing-folder", "with-lora", "unknown-adapter",
           "adapter-without-modules", "scale-without-adapter", "shims"]


@pytest.mark.parametrize("name", REFUSED)
def test_lora_modules_refusals(name, served, tiny_model, tmp_path):
    """One line each, exit 2, before any weight loads."""
    extra, expected = _refusal_cases(served, tmp_path)[name]
    proc = run_cli_in_process(["--prompt", "a fox", "--model-id", str(tiny_model), "--device", "cpu", "--image-size",
                               "64x64", "--save", str(tmp_path / "out.png"), *extra])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), (proc.stderr[-2000:],
                                                                                          proc.stdout[-1000:])
    assert "loaded" not in proc.stdout and not (tmp_path / "out.png").exists()


def test_lora_modules_refuse_unknown_lines(gained_model, served, tmp_path):
    """A prompts-file line naming no served adapter refused before launch, naming its line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox", "lora": "c"}) + "\n")
    proc = run_cli_in_process(["--prompts", str(prompts), "--save-dir", str(tmp_path / "out"), "--model-id",
                               str(gained_model), "--device", "cpu", "--lora-modules", f"a={served['a']}"])
    assert proc.returncode == 2 and proc.stderr.strip() == \
        f"error: prompts: {prompts}: line 1: adapter: 'c' is not an adapter of this job; use one of a, or leave it out for the " \
        "base", proc.stderr[-2000:]


@pytest.mark.slow
def test_python_api_adapters_and_the_planned_bytes(served, alone, gained_model, tmp_path):
    """Pipeline.load(..., lora_modules=...) and generate([{..., "adapter": ...}]): the Python API takes
    the same fields; the planner's "LoRA adapters" bytes are what the loaded rank holds (with an adapter
    of the routed experts among them: stacked per local expert)."""
    from lora_adapters import EXPERTS, random_adapter
    from adaptor_patches.lora_rows import bank_bytes
    from adaptor_patches.parallel.layout import Layout
    from utils.pipeline import Pipeline
    from utils.planner.memory_plan import plan
    from utils.planner.plan import planned_adapters
    modules = f"{modules_flag(served)},x={random_adapter(gained_model, tmp_path / 'x', targets=EXPERTS)}"
    pipe = Pipeline.load(gained_model, device="cpu", image_size="64x64", diff_infer_steps=3, seed=7,
                         lora_modules=modules)
    try:
        made = pipe.generate([{"prompt": PROMPT, "adapter": "a", "seed": 7}])
        held = bank_bytes(pipe.model.rank_context)
    finally:
        pipe.close()
    png = alone["a"].with_name("api_a.png")
    made[0].image.save(png)
    assert psnr(png, alone["a"]) >= PSNR_MIN_DB
    planned = plan(gained_model, Layout(), (64, 64), "cpu", adapters=planned_adapters(modules, gained_model))
    assert planned[0].params["LoRA adapters"] == held > 0, (planned[0].params, held)


def test_expert_adapters_see_int8_rows_dequantized():
    """int8 dispatch (the NPU set with W8A8 int8 experts, through tests/npu_double.py): the rows reach the
    experts as int8 with their per-token scales; the base part is what W8A8 computes from the bf16 rows
    (the same quantization, bit for bit), the adapters' part sees the rows dequantized (within int8
    rounding of the bf16 rows' result). Mutation: the int8 rows handed to the low rank as they are."""
    import npu_double
    import torch
    from adaptor_patches.kernels.quant import quantize_per_token
    from adaptor_patches.lora_rows import ExpertLowRank
    from adaptor_patches.moe.experts import GroupedExperts
    from adaptor_patches.parallel.shards import MoeShard
    kernels, expert_format = npu_double.w8a8_experts()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)                    # the experts' initial weights
    experts = GroupedExperts(64, 32, MoeShard("replicated", 4, 0, 4), kernels, 0.05, expert_format)

    def half(*shape):
        return (torch.randn(*shape, generator=generator) * 0.2).bfloat16()
    slot, scale = torch.tensor([0, 0, 0, 1, 1, 1]), torch.full((6,), 2.0)
    lows = (ExpertLowRank(half(4, 64, 6), half(4, 6, 64), slot, scale),
            ExpertLowRank(half(4, 32, 6), half(4, 6, 64), slot, scale))
    x, counts = torch.randn(12, 64, generator=generator).bfloat16(), torch.tensor([3, 4, 0, 5])
    rows = (torch.tensor([0, 1, -1] * 4), torch.ones(12))
    from_bf16 = experts.with_adapters(x, counts, lows, rows).float()
    q, x_scale = quantize_per_token(x, "int8")
    from_int8 = experts.with_adapters(q, counts, lows, rows, x_scale=x_scale).float()
    base = experts(x, counts).float()
    base_rows = rows[0] < 0
    assert torch.equal(from_int8[base_rows], base[base_rows]) and torch.equal(from_bf16[base_rows], base[base_rows])
    change, error = (from_bf16 - base).abs().max().item(), (from_int8 - from_bf16).abs().max().item()
    print(f"adapters' change {change:.3f}, int8 rows vs bf16 rows {error:.4f}")
    assert error <= 0.03 * change, (error, change)
