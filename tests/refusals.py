"""Replays tests/data/refusals.json: every refusal the tests exercise, by entry point, with the exact
stderr it gives and its exit code.

A case names its entry point (`cli`: run_image_gen.main, `launcher`: run.sh's launcher main,
`planner`, `selfcheck`, `convert`, `server`: one raw HTTP request, argv ["{model}", request], to a
server on that checkpoint in this process, its JSON error's message recorded as the `error:` line
and its status as the code), its argv and environment, the checkpoint it runs on and what is
done to a copy of it first (`copy`: the copy's folder name; `damage`: a named damage of the checkpoint
tests; `edit_json`: keys set in a JSON file of it; `model_files`: files written into it; `model_fifos`:
files replaced by named pipes; `drop`: files or folders removed), the files, folders, symlinks and
named pipes (`fifos`: a reader of one would wait for a writer for good) it needs under its own
temporary folder, and for the launcher the YAML (`yaml`: an object, `yaml_text`: text). A long text
may be written as a list of [piece, times] pairs ([["[", 5000], ["]", 5000]]). Strings hold
placeholders, replaced before the run and put back into what it printed: {tmp} (the case's folder),
{model} (its checkpoint), {root} (the project root), {port} (a port held busy during the run). A
file's text is stored as str; bytes that are not UTF-8 as surrogate escapes ("\\udce9" is byte 0xe9).

    python tests/refusals.py --record [ID_PREFIX...]   re-run the cases, write what they print now

Every case runs in this process (a refusal comes before any weight is read): the file replays in
seconds. tests/test_refusals.py compares.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "refusals.json"

LAUNCHER_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "moe_intermediate_size": 128}
REAL_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts": 64,
               "moe_intermediate_size": 3072}
ENTRY_SCRIPT = "import sys\nprint(sys.argv[1:])\nsys.exit(3)\n"
_INSTRUCT_GENERATION = {"sequence_template": "instruct", "bot_task": "think_recaption", "diff_guidance_scale": 2.5}
INSTRUCT_KEYS = {      # what adaptor_patches/model_family.py and utils/tiny_instruct.py set in the two files
    "instruct_config": {"config.json": {"model_version": "HunyuanImage-3.0-Instruct"},
                        "generation_config.json": {**_INSTRUCT_GENERATION, "diff_infer_steps": 50}},
    "distil_config": {"config.json": {"model_version": "HunyuanImage-3.0-Instruct-Distil", "cfg_distilled": True,
                                      "use_meanflow": True},
                      "generation_config.json": {**_INSTRUCT_GENERATION, "diff_infer_steps": 8}},
}


def load_cases() -> list:
    return json.loads(DATA.read_text(encoding="utf-8"))


class Models(dict):
    """The checkpoints cases name, each made when first asked for under `root`: `tiny` and `text`
    (given, or made), `config_only` (tiny's JSON files only), `instruct_config` / `distil_config`
    (those files with the keys that make them HunyuanImage-3.0-Instruct / -Distil: INSTRUCT_KEYS;
    a refusal of an image comes before any weight is looked for), `launcher_config` / `real_config` (a
    config.json of head and expert counts only), `converted_<split>`, `int8_<split>`,
    `recipe_<split>` (a cann-recipes folder) for the splits below."""

    SPLITS = {"one": (1, 1, 1), "tp2": (2, 2, 1), "ep2": (2, 1, 2), "attn1_ep2": (1, 1, 2)}

    def __init__(self, root: Path, **given):
        super().__init__(given)
        self.root = Path(root)

    def __missing__(self, name):
        out = self.root / name
        if name == "tiny":
            from utils.make_tiny_model import make_tiny_model
            path = make_tiny_model(out)
        elif name == "text":
            from harness.checkpoints import make_text_checkpoint
            path = make_text_checkpoint(self["tiny"], out)
        elif name == "config_only":
            out.mkdir(parents=True)
            for file in ("config.json", "generation_config.json"):
                shutil.copy(self["tiny"] / file, out / file)
            path = out
        elif name in INSTRUCT_KEYS:
            path = Path(shutil.copytree(self["config_only"], out))
            for file, changes in INSTRUCT_KEYS[name].items():
                data = json.loads((path / file).read_text())
                (path / file).write_text(json.dumps({**data, **changes}))
        elif name in ("launcher_config", "real_config"):
            out.mkdir(parents=True)
            (out / "config.json").write_text(json.dumps(LAUNCHER_CONFIG if name == "launcher_config" else REAL_CONFIG))
            path = out
        else:
            kind, split = name.split("_", 1)
            tp_attn, tp_moe, ep = self.SPLITS[split]
            if kind == "recipe":
                from recipe_checkpoint import make_recipe_checkpoint
                path = make_recipe_checkpoint(self["tiny"], out, tp_attn, tp_moe, ep)
            else:
                from utils import convert_model
                flags = ["--int8"] if kind == "int8" else []
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    code = convert_model.main(["--model-path", str(self["tiny"]), "--output-path", str(out),
                                               "--tp-attn", str(tp_attn), "--tp-moe", str(tp_moe), "--ep", str(ep),
                                               *flags])
                assert code == 0, name
                path = out
        self[name] = Path(path)
        return self[name]


def damages() -> dict:
    """Named damages of a checkpoint copy: the checkpoint tests' own (one definition each)."""
    from test_checkpoint_inputs import CASES
    from test_reliability import DAMAGE
    named = {f"checkpoint_inputs.{name}": damage for name, (damage, _) in CASES.items()}
    named.update({f"reliability.{name}": damage for name, damage in DAMAGE.items()})
    return named


def text_of(value) -> str:
    return value if isinstance(value, str) else "".join(piece * times for piece, times in value)


def substitute(value, names: dict):
    if isinstance(value, str):
        for key, real in names.items():
            value = value.replace("{" + key + "}", real)
        return value
    if isinstance(value, list):
        return [substitute(v, names) for v in value]
    if isinstance(value, dict):
        return {substitute(k, names): substitute(v, names) for k, v in value.items()}
    return value


def normalise(text: str, names: dict) -> str:
    """Paths and ports back to their placeholders (longest first, real paths too)."""
    pairs = []
    for key, value in names.items():
        pairs.append((value, key))
        if key != "port" and os.path.realpath(value) != value:
            pairs.append((os.path.realpath(value), key))
    for value, key in sorted(pairs, key=lambda pair: -len(pair[0])):
        text = text.replace(value, "{" + key + "}")
    return text


def prepare(case: dict, tmp: Path, models: Models) -> Path | None:
    """The case's checkpoint (a copy when it is damaged or edited) and its files under tmp."""
    model = models[case["model"]] if case.get("model") else None
    if model is not None and case.get("copy"):
        model = Path(shutil.copytree(model, tmp / case["copy"], symlinks=True))
        for name in case.get("damage", []):
            damages()[name](model)
        for file, changes in case.get("edit_json", {}).items():
            data = json.loads((model / file).read_text())
            (model / file).write_text(json.dumps({**data, **changes}))
        for file, text in case.get("model_files", {}).items():
            (model / file).write_text(text)
        for file in case.get("model_fifos", []):
            (model / file).unlink(missing_ok=True)
            os.mkfifo(model / file)
        for file in case.get("drop", []):
            target = model / file
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    return model


def write_inputs(case: dict, tmp: Path, names: dict) -> None:
    for folder in case.get("dirs", []):
        (tmp / substitute(folder, names)).mkdir(parents=True, exist_ok=True)
    for name, text in case.get("files", {}).items():
        path = tmp / substitute(name, names)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(substitute(text_of(text), names).encode("utf-8", "surrogateescape"))
    for name, target in case.get("links", {}).items():
        (tmp / name).symlink_to(substitute(target, names))
    for name in case.get("fifos", []):
        os.mkfifo(tmp / substitute(name, names))
    if "yaml" in case or "yaml_text" in case:
        import yaml
        text = text_of(case["yaml_text"]) if "yaml_text" in case else None
        if text is None:
            text = yaml.safe_dump(substitute(case["yaml"], names), sort_keys=False)
        (tmp / "job.yaml").write_text(substitute(text, names), encoding="utf-8")


def server_answer(model_dir: str, request: str) -> tuple:
    """(HTTP status, "", "error: <its JSON error's message>") of one raw request to a server on
    `model_dir` started in this process (no model: a refused request never reaches the rank loop)."""
    import http.client
    from utils.runtime.requests.image_requests import ImageRequest, RequestChecker
    from utils.runtime.http.image_server import ImageServer
    defaults = ImageRequest(prompt="", seed=None, image_size="64x64", diff_infer_steps=2)
    server = ImageServer("127.0.0.1", 0, defaults, RequestChecker(model_dir), 2, 2, lambda line: None, client_timeout=5.0)
    server.loaded.set()
    server.start()
    try:
        with socket.create_connection(server.server_address, timeout=60) as sock:
            sock.sendall(request.encode("utf-8", "surrogateescape"))
            response = http.client.HTTPResponse(sock)
            response.begin()
            body = response.read()
    finally:
        server.close()
    return response.status, "", f"error: {json.loads(body)['error']['message']}\n"


def call(entry: str, argv: list, env: dict) -> tuple:
    """(exit code, stdout, stderr) of one entry point's main(argv), in this process."""
    if entry == "server":
        return server_answer(*argv)
    if entry == "cli":
        from generation import run_cli_in_process
        proc = run_cli_in_process(argv, env=env)
        return proc.returncode, proc.stdout, proc.stderr
    if entry == "launcher":
        from test_launcher import run_launcher_in_process
        from unittest import mock
        with mock.patch.dict(os.environ, env):
            proc = run_launcher_in_process(*argv)
        return proc.returncode, proc.stdout, proc.stderr
    from unittest import mock
    if entry == "planner":
        from utils.planner.plan import main
    elif entry == "selfcheck":
        from utils.selfcheck.selfcheck import main
    elif entry == "convert":
        from utils.convert_model import main
    else:
        raise ValueError(f"unknown entry point {entry!r}")
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env), contextlib.chdir(ROOT), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def replay(case: dict, tmp: Path, models: Models) -> dict:
    """{"stderr": [its `error:` lines, placeholders put back], "code": exit code} of one case run now
    (other stderr lines, e.g. a third-party warning printed once per process, depend on what ran
    before in the process). An exception that escapes main() is code "traceback" and its last line."""
    tmp = Path(tmp)
    model = prepare(case, tmp, models)
    names = {"tmp": str(tmp), "root": str(ROOT)}
    if model is not None:
        names["model"] = str(model)
    with contextlib.ExitStack() as stack:
        if case.get("busy_port"):
            busy = stack.enter_context(socket.socket())
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            names["port"] = str(busy.getsockname()[1])
        write_inputs(case, tmp, names)
        try:
            code, _, stderr = call(case["entry"], substitute(case["argv"], names),
                                   substitute(case.get("env", {}), names))
        except Exception as exc:        # the entry point let it escape: a traceback, which no case may end in
            code, stderr = "traceback", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    lines = [normalise(line, names) for line in stderr.strip().splitlines()]
    if code != "traceback":
        lines = [line for line in lines if line.startswith("error:") or "Traceback" in line]
    return {"stderr": lines, "code": code}


def record(prefixes: list) -> None:
    cases = load_cases()
    with tempfile.TemporaryDirectory(prefix="refusals-") as root:
        models = Models(Path(root) / "models")
        for i, case in enumerate(cases):
            if prefixes and not any(case["id"].startswith(p) for p in prefixes):
                continue
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                case.update(replay(case, Path(tmp), models))
            print(f"{case['id']}: {case['code']} {case['stderr'][-1] if case['stderr'] else ''}", flush=True)
    write_cases(cases)


def write_cases(cases: list) -> None:
    """One case per line: a re-recorded line shows as that case's line in the diff."""
    lines = ",\n".join(json.dumps(case, ensure_ascii=True) for case in cases)
    DATA.write_text(f"[\n{lines}\n]\n", encoding="utf-8")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))          # run by path (--record): the repo root, for its packages
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/refusals.py --record [ID_PREFIX...]")
    record(sys.argv[2:])
