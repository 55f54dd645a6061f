"""The one job check (utils/runtime/requests/job_check.py): run_image_gen.py's every rank and run.sh's launcher
call it once, so a job the ranks refuse is refused before launch, in the same words."""
import pytest

from generation import run_cli_in_process
from test_launcher import run_launcher_in_process, write_yaml


def cli_and_yaml(tiny_model, tmp_path, cli_flags, yaml_args, drop_prompt=False):
    """(the CLI's stderr, the launcher's --dry-run stderr) for one job, given both ways."""
    base = [] if drop_prompt else ["--prompt", "a fox"]
    cli = run_cli_in_process([*base, "--model-id", tiny_model, "--device", "cpu", "--image-size", "64x64",
                              *cli_flags])
    margs = {"prompt": "a fox", "model-id": str(tiny_model), "device": "cpu", "image-size": "64x64", **yaml_args}
    if drop_prompt:
        del margs["prompt"]
    job = {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py", "model_args": margs}
    yaml = run_launcher_in_process(write_yaml(tmp_path, job), "--dry-run", "--no-plan")
    return cli, yaml


def think_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a fox", "bot_task": "think"}\n')
    return path


CASES = {
    "no_mode": ([], {}, True),
    "system_prompt_custom": (["--use-system-prompt", "custom"], {"use-system-prompt": "custom"}, False),
    "save_is_a_directory": (["--save", "{tmp}"], {"save": "{tmp}"}, False),
    "save_in_the_model_dir": (["--save", "{model}/out.png"], {"save": "{model}/out.png"}, False),
    "step_cache_blocks_every_layer": (["--step-cache", "adaptive", "--step-cache-blocks", "2"],
                                      {"step-cache": "adaptive", "step-cache-blocks": 2}, False),
    "quant_compute_8bit_on_cpu": (["--quant-compute", "8bit"], {"quant-compute": "8bit"}, False),
    "moe_tp_and_ep": (["--moe-tp", "--moe-ep"], {"moe-tp": True, "moe-ep": True}, False),
    "serve_with_rounds": (["--serve", "--rounds", "2"], {"serve": True, "rounds": 2}, True),
    "think_line_on_a_base_checkpoint": (["--prompts", "{prompts}"], {"prompts": "{prompts}"}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_launcher_refuses_what_the_ranks_refuse_in_their_words(tiny_model, tmp_path, case):
    cli_flags, yaml_args, drop_prompt = CASES[case]
    names = {"{tmp}": str(tmp_path), "{model}": str(tiny_model), "{prompts}": str(think_line(tmp_path))}

    def fill(value):
        for key, real in names.items():
            value = value.replace(key, real) if isinstance(value, str) else value
        return value
    cli, yaml = cli_and_yaml(tiny_model, tmp_path, [fill(v) for v in cli_flags],
                             {k: fill(v) for k, v in yaml_args.items()}, drop_prompt)
    cli_lines, yaml_lines = cli.stderr.strip().splitlines(), yaml.stderr.strip().splitlines()
    assert cli.returncode == yaml.returncode == 2 and len(cli_lines) == len(yaml_lines) == 1, (cli.stderr, yaml.stderr)
    field, rest = cli_lines[0][len("error: "):].split(": ", 1)
    named = field if case == "moe_tp_and_ep" else f"model_args.{field}"       # the layout's own field names
    assert yaml_lines[0] == f"error: {named}: {rest}"


def test_check_job_runs_once_in_the_cli_and_once_in_the_launcher(tiny_model, tmp_path, monkeypatch):
    """Once per process: the CLI's main (then the checkpoint step refuses: no weight is read) and the
    launcher's dry run each call it exactly once."""
    import shutil
    import run_image_gen
    from utils.runtime.requests import job_check
    calls = []
    check = job_check.check_job

    def counted(*args, **kwargs):
        calls.append(kwargs.get("writes_outputs"))
        return check(*args, **kwargs)
    monkeypatch.setattr(run_image_gen, "check_job", counted)
    monkeypatch.setattr(job_check, "check_job", counted)
    damaged = shutil.copytree(tiny_model, tmp_path / "ckpt")
    (damaged / "tokenizer.json").unlink()
    proc = run_cli_in_process(["--prompt", "a fox", "--model-id", damaged, "--device", "cpu", "--save",
                               tmp_path / "never.png"])
    assert proc.returncode == 2 and "has no tokenizer.json" in proc.stderr and calls == [True], (calls, proc.stderr)
    job = {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "a fox", "model-id": str(tiny_model), "device": "cpu", "image-size": "64x64"}}
    assert run_launcher_in_process(write_yaml(tmp_path, job), "--dry-run", "--no-plan").returncode == 0
    assert calls == [True, True]
