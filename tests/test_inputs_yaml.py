"""run.sh's YAML: what used to traceback, eat memory or pass wrongly is one `error:` line before launch."""
import resource
import shutil
import time

import pytest

from test_launcher import assert_one_error, run_launcher, write_yaml


def job(tiny_model, **model_args):
    return {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py",
            "model_args": {"prompt": "a fox", "model-id": str(tiny_model), "device": "cpu", **model_args}}


def dry_run(tmp_path, text):
    return run_launcher(write_yaml(tmp_path, text), "--dry-run")


def test_a_config_nested_5000_deep_is_refused_without_recursion_error(tiny_model, tmp_path):
    res = dry_run(tmp_path, "world_size: 1\nmodel_args:\n  prompt: " + "[" * 5000 + "]" * 5000 + "\n")
    assert_one_error(res, "config: nested deeper than 50 levels")


def test_an_alias_bomb_is_refused_quickly_in_little_memory(tiny_model, tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 8) + "]" for i in range(1, 10)]      # 8^10 ~ 2^30 values
    start, peak = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = dry_run(tmp_path, "\n".join(lines) + "\n")
    # a4 is the first key whose value alone expands past the limit (8^5 + ... > 20000)
    assert_one_error(res, "error: a4: aliases expand its value to more than 20000 values (line 5); write the values "
                          "out; drop the aliases")
    assert time.monotonic() - start < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024       # KiB: < 200 MiB more


def test_an_alias_bomb_inside_model_args_names_its_key(tiny_model, tmp_path):
    lines = ["world_size: 1", "master_port: 29611", "entry_script: run_image_gen.py", "model_args:",
             f"  model-id: {tiny_model}", '  prompt: &p "a fox"', "  extra: &x [*p, *p, *p, *p, *p, *p, *p, *p]"]
    lines += [f"  extra{i}: &x{i} [" + ", ".join([f"*x{i - 1}" if i > 1 else "*x"] * 8) + "]" for i in range(1, 7)]
    res = dry_run(tmp_path, "\n".join(lines) + "\n")
    assert_one_error(res, "error: model_args.extra4: aliases expand its value to more than 20000 values (line 11)")


def test_a_few_aliases_are_still_fine(tiny_model, tmp_path):
    text = (f"world_size: 1\nmaster_port: 29611\nentry_script: run_image_gen.py\nenv_vars: &env {{OMP_NUM_THREADS: 1}}\n"
            f"model_args:\n  prompt: a fox\n  model-id: {tiny_model}\n  device: cpu\n")
    res = dry_run(tmp_path, text)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("value, where", [(".nan", "top"), (".inf", "top"), ("-.inf", "top"), (".inf", "model_args"),
                                          (".nan", "model_args")])
def test_dist_timeout_nan_or_inf_is_refused(tiny_model, tmp_path, value, where):
    text = (f"world_size: 1\nmaster_port: 29611\nentry_script: run_image_gen.py\n"
            f"model_args:\n  prompt: a fox\n  model-id: {tiny_model}\n  device: cpu\n")
    text += f"dist_timeout: {value}\n" if where == "top" else f"  dist-timeout: {value}\n"
    field = "dist_timeout" if where == "top" else "model_args.dist-timeout"
    assert_one_error(dry_run(tmp_path, text), f"error: {field}: ")


@pytest.mark.parametrize("script", ["README.md", "config/tiny_cpu.yaml", "run.sh"])
def test_an_entry_script_that_is_not_python_is_refused(tiny_model, tmp_path, script):
    res = run_launcher(write_yaml(tmp_path, {**job(tiny_model), "entry_script": script}), "--dry-run")
    assert_one_error(res, "error: entry_script: ")
    assert "not a Python file" in res.stderr


@pytest.mark.parametrize("name, value", [("CFG_PARALLEL", "maybe"), ("USE_VAE_PARALLEL", "2")])
def test_an_on_off_environment_switch_with_another_value_is_refused(tiny_model, tmp_path, name, value):
    res = run_launcher(write_yaml(tmp_path, {**job(tiny_model), "env_vars": {name: value}}), "--dry-run")
    assert_one_error(res, f"error: env_vars.{name}: ")


@pytest.mark.parametrize("where, line", [
    ("env_vars", "error: env_vars.NOTE: value 'a\\x00b' contains a NUL byte; remove it (an environment variable "
                 "cannot hold one)"),
    ("model_args", "error: model_args.prompt: 'a fox\\x00 in snow' contains a NUL byte; remove it (a command line "
                   "cannot carry one)"),
    ("model_name", "error: model_name: ")])
def test_a_nul_byte_is_refused_as_a_field_before_torchrun(tiny_model, tmp_path, where, line):
    """A real launch (not --dry-run): the value would reach torchrun's environment or command line,
    where Popen refuses it (`launcher: unexpected ValueError: embedded null byte`). No log, no job."""
    from harness.multirank import free_port
    from test_launcher import ROOT, run_launcher_in_process
    name = f"nul-test-{tmp_path.name}"
    spec = {**job(tiny_model), "master_port": free_port(), "model_name": name}
    if where == "env_vars":
        spec["env_vars"] = {"NOTE": "a\0b"}
    elif where == "model_args":
        spec["model_args"]["prompt"] = "a fox\0 in snow"
    else:
        spec["model_name"] = name + "\0"
    res = run_launcher_in_process(write_yaml(tmp_path, spec), "--no-plan")
    logs = list((ROOT / "res").glob(f"*/{name}*"))
    for folder in logs:                 # a launch that got as far as its log
        shutil.rmtree(folder)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
    assert_one_error(res, line)
    assert not logs and "log: " not in res.stdout


@pytest.mark.parametrize("key, value", [("diff-infer-steps", 1000000000), ("verbose", -1), ("seed", 2**32),
                                        ("image-size", "99999x99999"), ("prompt", "   "), ("save", "a\0b.png")])
def test_model_args_follow_the_request_schema(tiny_model, tmp_path, key, value):
    res = run_launcher(write_yaml(tmp_path, job(tiny_model, **{key: value})), "--dry-run")
    assert_one_error(res, f"error: model_args.{key}: ")


def test_outputs_may_not_land_on_the_yaml_the_checkpoint_or_each_other(tiny_model, tmp_path):
    yaml_path = tmp_path / "job.yaml"
    for outputs, field in (({"save": str(yaml_path)}, "model_args.save"),
                           ({"save": str(tiny_model / "config.json")}, "model_args.save"),
                           ({"save": str(tmp_path / "a.png"), "metrics-json": str(tmp_path / "a.png")},
                            "model_args.metrics-json")):
        res = run_launcher(write_yaml(tmp_path, job(tiny_model, **outputs)), "--dry-run")
        assert_one_error(res, f"error: {field}: ")


def test_a_prompts_file_line_escaping_save_dir_is_refused_before_launch(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a fox", "save": "../x.png"}\n')
    spec = job(tiny_model, **{"save-dir": str(tmp_path / "out"), "prompts": str(prompts)})
    del spec["model_args"]["prompt"]
    res = run_launcher(write_yaml(tmp_path, spec), "--dry-run")
    assert_one_error(res, f"error: model_args.prompts: {prompts}: line 1: save: '../x.png' climbs out with '..'")
