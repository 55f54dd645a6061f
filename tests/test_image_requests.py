"""Prompts files, API bodies and the rank loop's agreement: what is checked before any rank runs."""
import json

import pytest

from generation import run_cli_in_process
from utils.runtime.requests.image_requests import ImageRequest, RequestChecker, RequestError, read_prompts_file
from utils.runtime.http.image_server import BadRequest, parse_body
from utils.runtime.engine.rank_loop import RankFailure, RankLoop

DEFAULTS = ImageRequest(prompt="", seed=None, image_size="64x64", diff_infer_steps=3)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_text_file_one_prompt_per_line_named_by_line_number(tmp_path):
    path = write(tmp_path, "p.txt", "A red Fox, in snow!\n\n# a comment\n  a blue bird  \n")
    requests = read_prompts_file(path, DEFAULTS, tmp_path / "out")
    assert [r.prompt for r in requests] == ["A red Fox, in snow!", "a blue bird"]
    assert [r.label for r in requests] == ["line 1", "line 4"]
    assert requests[0].save == str(tmp_path / "out" / "0001_a-red-fox-in-snow.png")
    assert requests[1].save.endswith("0004_a-blue-bird.png")
    assert all(r.image_size == "64x64" and r.diff_infer_steps == 3 and r.seed is None for r in requests)


def test_jsonl_fields_override_the_flags(tmp_path):
    path = write(tmp_path, "p.jsonl", json.dumps({"prompt": "a cat", "seed": 5, "image_size": "32x48",
                                                  "diff_infer_steps": 2, "save": "cat"}) + "\n"
                 + json.dumps({"prompt": "a dog"}) + "\n")
    cat, dog = read_prompts_file(path, DEFAULTS, tmp_path)
    assert (cat.seed, cat.image_size, cat.diff_infer_steps, cat.save) == (5, "32x48", 2, str(tmp_path / "cat.png"))
    assert (dog.seed, dog.image_size, dog.save) == (None, "64x64", str(tmp_path / "0002_a-dog.png"))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "seed": -1}', "line 2: seed: -1 is not an integer"),
    ('{"prompt": "x", "seed": true}', "line 2: seed: True is not an integer"),
    ('{"prompt": ""}', "line 2: prompt: empty"),
    ('{"seed": 3}', "line 2: prompt: missing"),
    ('{"prompt": "x", "steps": 3}', "line 2: unknown field 'steps'"),
    ('{"prompt": "x", "image_size": "big"}', "line 2: image_size: 'big' is not auto, HxW or H:W"),
    ('{"prompt": "x", "diff_infer_steps": 0}', "line 2: diff_infer_steps: 0 is not an integer in 1..1000"),
    ('{"prompt": "x", "bot_task": "paint"}', "line 2: bot_task: 'paint' is not one of"),
    ('{"prompt": "x"', "line 2: not JSON"),
    ('["x"]', "line 2: a JSON list, not an object"),
    ('{"prompt": "x", "save": "0001_ok"}', "line 2: save: "),
])
def test_a_bad_line_names_its_number_and_field(tmp_path, line, message):
    path = write(tmp_path, "p.jsonl", '{"prompt": "ok", "save": "0001_ok"}\n' + line + "\n")
    with pytest.raises(RequestError) as info:
        read_prompts_file(path, DEFAULTS, tmp_path)
    assert str(info.value).startswith(message), str(info.value)


def test_a_request_survives_the_broadcast_to_the_other_ranks():
    """rank 0 hands requests to the others with broadcast_object_list, i.e. pickle."""
    import pickle
    request = ImageRequest("a fox", seed=3, image_size="64x48", label="line 2")
    assert pickle.loads(pickle.dumps(request)) == request


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(RequestError, match="has no prompt"):
        read_prompts_file(write(tmp_path, "p.txt", "\n# only a comment\n"), DEFAULTS, tmp_path)


def test_checker_refuses_text_tasks_the_checkpoint_lacks_and_long_prompts(tiny_model, tmp_path):
    checker = RequestChecker(tiny_model)
    think = write(tmp_path, "think.jsonl", '{"prompt": "x"}\n{"prompt": "x", "bot_task": "think"}\n')
    with pytest.raises(RequestError, match="line 2: bot_task: 'think' needs a checkpoint with the instruct"):
        read_prompts_file(think, DEFAULTS, tmp_path, checker)
    long = write(tmp_path, "long.txt", "fox " * 13000 + "\n")
    with pytest.raises(RequestError, match=r"line 1: prompt: \d+ tokens, but the model's context is 12800"):
        read_prompts_file(long, DEFAULTS, tmp_path, checker)


def test_cli_refuses_a_bad_line_before_loading_and_writes_nothing(tiny_model, tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a fox"}\n{"prompt": "a cat", "image_size": "64x"}\n')
    proc = run_cli_in_process(["--prompts", path, "--model-id", tiny_model, "--device", "cpu",
                               "--save-dir", tmp_path / "out"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: prompts: {path}: line 2: image_size: '64x' is not auto, HxW or H:W; use e.g. 1024x1024"]
    assert "loaded" not in proc.stdout and not list((tmp_path / "out").glob("*.png"))


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--prompts", "p.txt"], "error: prompt: pass exactly one of --prompt TEXT, --prompts FILE or "
                                              "--serve (got --prompt, --prompts)"),
    ([], "error: prompt: pass exactly one of"),
    (["--serve", "--save", "x.png"], "error: save: only with --prompt"),
    (["--prompts", "p.txt", "--rounds", "2"], "error: rounds: only with --prompt"),
    (["--serve", "--port", "70000"], "error: port: 70000 is not an integer in 0..65535"),
    (["--serve", "--queue-size", "0"], "error: queue-size: 0 is not an integer >= 1"),
])
def test_cli_mode_flags_are_checked(tiny_model, tmp_path, argv, message):
    (tmp_path / "p.txt").write_text("a fox\n")
    argv = [str(tmp_path / a) if a == "p.txt" else a for a in argv]
    proc = run_cli_in_process([*argv, "--model-id", tiny_model, "--device", "cpu"])
    assert proc.returncode == 2 and proc.stderr.strip().startswith(message), proc.stderr


def test_api_body_maps_openai_fields_to_requests(tiny_model):
    checker = RequestChecker(tiny_model)
    requests = parse_body({"prompt": "a fox", "n": 3, "size": "96x64", "seed": 10, "steps": 2, "model": "tiny",
                           "response_format": "b64_json"}, DEFAULTS, checker, max_n=4)
    assert [r.seed for r in requests] == [10, 11, 12]
    assert {(r.image_size, r.diff_infer_steps, r.save) for r in requests} == {("64x96", 2, None)}   # WxH -> HxW
    defaults = parse_body({"prompt": "a fox", "n": 2}, DEFAULTS, checker, 4)
    assert [(r.seed, r.image_size) for r in defaults] == [(None, "64x64")] * 2        # the server's flags


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 5}, "n"), ({"prompt": "x", "n": 0}, "n"), ({"n": 1}, "prompt"),
    ({"prompt": "x", "size": "64"}, "size"), ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "seed": "7"}, "seed"), ({"prompt": "x", "steps": 0}, "steps"),
    ({"prompt": "x", "colour": "red"}, "colour"), ({"prompt": "fox " * 13000}, "prompt"),
    ({"prompt": "x", "bot_task": "think"}, "bot_task"), ({"prompt": "x", "model": "dall-e-3"}, "model"),
])
def test_api_body_problems_name_the_field(tiny_model, body, param):
    with pytest.raises(BadRequest) as info:
        parse_body(body, DEFAULTS, RequestChecker(tiny_model), max_n=4)
    assert info.value.param == param, str(info.value)


class CollectiveError(RuntimeError):
    pass


class Stages:
    """The rank loop's two stages without a model: a text phase that may fail per request, an image
    stage that may fail for its whole forward batch."""

    def __init__(self, text_fails=(), image_fails=False):
        self.text_fails, self.image_fails, self.calls = text_fails, image_fails, []

    def text(self, requests, keep_going):
        out = []
        for request in requests:
            self.calls.append(("text", request.prompt))
            try:
                if request.prompt in self.text_fails:
                    raise self.text_fails[request.prompt]
                out.append(f"handoff of {request.prompt}")
            except Exception as exc:
                if not keep_going(exc):
                    raise
                out.append(exc)
        return out

    def image(self, requests, handoffs):
        going = [r.prompt for r, h in zip(requests, handoffs) if h is not None]
        self.calls.append(("image", going))
        if self.image_fails:
            raise ValueError("out of memory")
        return [None if h is None else (f"image of {r.prompt}", {"text": None}, None, len(going))
                for r, h in zip(requests, handoffs)]


def test_rank_loop_reports_a_request_every_rank_failed_and_goes_on():
    from adaptor_patches.denoise_watch import DenoiseCancelled
    stages = Stages(text_fails={"bad": ValueError("no room in the context")})
    messages = iter([("run", [ImageRequest("good")]), ("tick", None), ("run", [ImageRequest("bad"), ImageRequest("ok")]),
                     ("stop", None)])
    delivered = []
    RankLoop(None, 0, stages, lambda exc: isinstance(exc, CollectiveError)).run(lambda: next(messages),
                                                                                delivered.append)
    assert stages.calls == [("text", "good"), ("image", ["good"]), ("text", "bad"), ("text", "ok"), ("image", ["ok"])]
    assert [[(r.image, r.error, r.batch_size) for r in batch] for batch in delivered] == [
        [("image of good", None, 1)], [(None, "ValueError: no room in the context", 1), ("image of ok", None, 1)]]
    loop = RankLoop(None, 0, Stages(image_fails=True), lambda exc: False)       # a forward batch fails as a whole
    results = loop.run_batch([ImageRequest("a"), ImageRequest("b")])
    assert [r.error for r in results] == ["ValueError: out of memory"] * 2
    stages = Stages()
    stages.image = lambda requests, handoffs: [("image of a", None, None, 1), DenoiseCancelled("cancelled at step 2")]
    results = RankLoop(None, 0, stages, lambda exc: False).run_batch([ImageRequest("a"), ImageRequest("b")])
    assert [(r.image, r.error) for r in results] == [("image of a", None), (None, "DenoiseCancelled: cancelled at step 2")]


def test_rank_loop_stops_when_ranks_disagree_or_a_collective_failed():
    loop = RankLoop(None, 0, Stages(text_fails={"x": ValueError("boom")}), lambda exc: isinstance(exc, CollectiveError))
    loop.agree = lambda outcome: [outcome, [None] * len(outcome)]     # rank 1's text phase succeeded where rank 0's failed
    with pytest.raises(RankFailure, match="rank 0 failed on line 3 .ValueError: boom. while 1 rank.s. succeeded"):
        loop.run_batch([ImageRequest("x", label="line 3")])
    loop = RankLoop(None, 0, Stages(image_fails=True), lambda exc: False)
    # the image stage's agreement is (its failure, each request's own): rank 1's image stage succeeded
    loop.agree = lambda outcome: [outcome, (None, [None] * len(outcome[1])) if isinstance(outcome, tuple) else outcome]
    with pytest.raises(RankFailure, match="rank 0 failed on line 1, line 2 .ValueError: out of memory."):
        loop.run_batch([ImageRequest("a", label="line 1"), ImageRequest("b", label="line 2")])
    loop = RankLoop(None, 0, Stages(text_fails={"x": CollectiveError("timed out")}),
                    lambda exc: isinstance(exc, CollectiveError))
    with pytest.raises(CollectiveError):
        loop.run_batch([ImageRequest("x")])


def test_serve_on_a_taken_port_is_one_line_before_the_load(tiny_model):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli_in_process(["--serve", "--port", port, "--model-id", tiny_model, "--device", "cpu"])
    assert proc.returncode == 2 and "loaded" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [f"error: port: cannot listen on 127.0.0.1:{port} (Address already "
                                                f"in use); pick another --port or stop what uses it"]


def test_launcher_checks_the_prompts_file_and_accepts_the_serve_config(tiny_model, tmp_path):
    """run.sh: a prompts file's bad line is one error before launch; the shipped serve config and a
    batch config validate and map to the CLI's flags."""
    import yaml
    from test_launcher import ROOT, run_launcher, write_yaml
    prompts = write(tmp_path, "p.jsonl", '{"prompt": "a fox", "seed": 1}\n{"prompt": "a cat", "sed": 2}\n')
    job = {"world_size": 2, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompts": str(prompts), "save-dir": str(tmp_path / "out"), "skip-existing": True,
                          "model-id": str(tiny_model), "device": "cpu", "cfg-parallel": True}}
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: model_args.prompts: {prompts}: line 2: unknown field 'sed'; fields are prompt, seed, image_size, "
        f"diff_infer_steps, bot_task, save, step_cache, image, guidance_scale, adapter, lora_scale"]
    prompts.write_text('{"prompt": "a fox", "seed": 1}\n')
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 0 and f"--prompts {prompts}" in res.stdout and "--skip-existing" in res.stdout
    serve = yaml.safe_load((ROOT / "config" / "tiny_cpu_serve.yaml").read_text())
    serve["model_args"]["model-id"] = str(tiny_model)
    res = run_launcher(write_yaml(tmp_path, serve), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "--serve --host 127.0.0.1 --port 8000 --queue-size 8" in res.stdout
