"""run.sh / utils/launcher/launch.py: YAML validation, the exact torchrun command, and a real CPU launch."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.multirank import free_port

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "run.sh"
TINY_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "moe_intermediate_size": 128}
SCRUBBED_ENV = ("CFG_PARALLEL", "USE_VAE_PARALLEL", "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE",
                "CPU_AFFINITY_CONF", "HCCL_OP_EXPANSION_MODE")
# Each rank prints its arguments, then waits (up to 60 s) until every rank has printed before it exits:
# torchrun stops the other ranks as soon as one exits non-zero, which on a loaded machine could be
# before a slower rank had started.
ENTRY = """import os, sys, time
from pathlib import Path
try:
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}", flush=True)
    printed = Path(__file__).with_name("printed")
    printed.mkdir(exist_ok=True)
    (printed / os.environ["RANK"]).touch()
    deadline = time.monotonic() + 60
    while len(list(printed.iterdir())) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(60 if "--sleep" in sys.argv else 0)
except KeyboardInterrupt:
    print(f"rank {os.environ['RANK']} interrupted", flush=True)
    sys.exit(5)
sys.exit(3)
"""


def launcher_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["PYTHON"] = sys.executable
    return env


def run_launcher(*args, timeout=60) -> subprocess.CompletedProcess:
    """`bash run.sh ARGS`. A --dry-run only validates and prints, so it runs in this process (the
    launcher's own main(), same environment); a real launch runs through run.sh."""
    if "--dry-run" in args:
        return run_launcher_in_process(*args)
    return subprocess.run(["bash", str(RUN_SH), *map(str, args)], cwd=ROOT, env=launcher_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_launcher_in_process(*args) -> subprocess.CompletedProcess:
    import contextlib
    import io
    from unittest import mock
    from utils.launcher import launch
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, launcher_env(), clear=True), contextlib.chdir(ROOT), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main([str(a) for a in args])
    return subprocess.CompletedProcess(["run.sh", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_run_sh_dry_run_through_bash(tmp_path, base):
    """The bash wrapper itself (PYTHON, exec, exit code) on one dry run."""
    res = subprocess.run(["bash", str(RUN_SH), str(write_yaml(tmp_path, base)), "--dry-run"], cwd=ROOT,
                         env=launcher_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "torch.distributed.run" in res.stdout, res.stderr


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "launcher_test_model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture
def entry(tmp_path) -> Path:
    path = tmp_path / "entry.py"
    path.write_text(ENTRY)
    return path


@pytest.fixture
def base(model_dir, entry) -> dict:
    return {"world_size": 1, "master_port": 29611, "entry_script": str(entry), "env_vars": {"OMP_NUM_THREADS": 1},
            "model_args": {"prompt": "a red fox", "model-id": str(model_dir), "device": "cpu", "seed": 42,
                           "diff-infer-steps": 4, "image-size": "64x64"}}


def only_plan_lines(stderr: str) -> bool:
    """A dry run's stderr: nothing but run.sh's plan line (or why this test config cannot be planned:
    its config.json holds only the fields the layout checks read)."""
    from utils.runtime.engine.rank_console import is_known_harmless
    # in process, the first import of upstream in this test process may log a known-harmless warning
    # (run.sh's own console routes it to the log: tests/test_console.py)
    return all(line.startswith(("plan: ", "note: plan skipped")) or is_known_harmless(line)
               for line in stderr.splitlines())


def write_yaml(tmp_path, data) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def assert_one_error(res: subprocess.CompletedProcess, field: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert field in lines[0], lines[0]
    assert "Traceback" not in res.stderr + res.stdout


def top(key, value):
    return lambda cfg: cfg.update({key: value})


def arg(key, value):
    return lambda cfg: cfg["model_args"].update({key: value})


def drop(key):
    return lambda cfg: cfg.pop(key)


BAD_CONFIGS = {
    "unknown_key": (lambda cfg: cfg.update(wordl_size=1), "wordl_size: unknown top-level key; did you mean 'world_size'"),
    "missing_key": (drop("entry_script"), "entry_script: missing"),
    "world_size_zero": (top("world_size", 0), "world_size:"),
    "world_size_negative": (top("world_size", -2), "world_size:"),
    "world_size_string": (top("world_size", "2"), "world_size:"),
    "world_size_bool": (top("world_size", True), "world_size:"),
    "master_port_zero": (top("master_port", 0), "master_port:"),
    "master_port_too_big": (top("master_port", 70000), "master_port:"),
    "master_port_string": (top("master_port", "29500"), "master_port:"),
    "node_rank_not_below_nnodes": (lambda cfg: cfg.update(nnodes=2, node_rank=2), "node_rank:"),
    "nnodes_zero": (top("nnodes", 0), "nnodes:"),
    "master_addr_blank": (top("master_addr", ""), "master_addr:"),
    "entry_script_missing": (top("entry_script", "no_such_script.py"), "entry_script:"),
    "env_vars_list": (top("env_vars", ["OMP_NUM_THREADS=1"]), "env_vars:"),
    "env_vars_nested": (top("env_vars", {"A": {"b": 1}}), "env_vars.A:"),
    "env_vars_bad_name": (top("env_vars", {"1BAD": 1}), "env_vars.1BAD:"),
    "build_tiny_model_string": (top("build_tiny_model", "yes"), "build_tiny_model:"),
    "model_args_list": (top("model_args", ["--prompt", "x"]), "model_args:"),
    "model_args_underscore": (arg("diff_infer_steps", 4), "model_args.diff_infer_steps:"),
    "model_args_nested": (arg("extra", {"a": 1}), "model_args.extra:"),
    "moe_tp_and_ep": (lambda cfg: cfg["model_args"].update({"moe-tp": True, "moe-ep": True}), "moe-tp/moe-ep:"),
    "moe_tp_not_bool": (arg("moe-tp", "yes"), "model_args.moe-tp:"),
    "device_unknown": (arg("device", "tpu"), "model_args.device:"),
    "model_id_missing_dir": (arg("model-id", "/nonexistent/launcher/model"), "model_args.model-id:"),
    "model_id_absent": (lambda cfg: cfg["model_args"].pop("model-id"), "model_args.model-id:"),
    "cfg_parallel_odd_world": (lambda cfg: cfg.update(world_size=3) or cfg["model_args"].update({"cfg-parallel": True}),
                               "cfg-parallel:"),
    "cfg_parallel_env_odd_world": (lambda cfg: cfg.update(world_size=3, env_vars={"CFG_PARALLEL": 1}), "cfg-parallel:"),
    "moe_ep_experts_do_not_split": (lambda cfg: cfg.update(world_size=3) or cfg["model_args"].update({"moe-ep": True}),
                                    "moe-ep:"),
    "moe_tp_multinode_does_not_split": (
        lambda cfg: cfg.update(world_size=3, nnodes=2, master_addr="127.0.0.1") or cfg["model_args"].update({"moe-tp": True}), "moe-tp:"),
    "steps_negative": (arg("diff-infer-steps", -1), "model_args.diff-infer-steps:"),
    "steps_zero": (arg("diff-infer-steps", 0), "model_args.diff-infer-steps:"),
    "steps_string": (arg("diff-infer-steps", "four"), "model_args.diff-infer-steps:"),
    "image_size_single_number": (arg("image-size", "64"), "model_args.image-size:"),
    "image_size_zero": (arg("image-size", "0x64"), "model_args.image-size:"),
    "image_size_word": (arg("image-size", "large"), "model_args.image-size:"),
    "seed_string": (arg("seed", "abc"), "model_args.seed:"),
    "seed_float": (arg("seed", 1.5), "model_args.seed:"),
    "warmup_negative": (arg("warmup", -1), "model_args.warmup:"),
    "rounds_zero": (arg("rounds", 0), "model_args.rounds:"),
    "multi_stream_bad": (arg("multi-stream", "maybe"), "model_args.multi-stream:"),
    "quant_compute_unknown": (arg("quant-compute", "w4a4"), "model_args.quant-compute:"),
    "quant_compute_8bit_on_cpu": (lambda cfg: cfg["model_args"].update({"device": "cpu", "quant-compute": "8bit"}),
                                  "model_args.quant-compute: w8a8 (8-bit weights, activations quantized per token) "
                                  "runs on npu with int8 experts, cuda with fp8 experts only, not on cpu"),
    "prompt_empty": (arg("prompt", "  "), "model_args.prompt:"),
    # cann-recipes keys: theirs are taken, a misspelt one and their launcher's keys for other models are not
    "model_name_misspelt": (top("model_nmae", "x"), "model_nmae: unknown top-level key; did you mean 'model_name'"),
    "model_name_path": (top("model_name", "../elsewhere"), "model_name:"),
    "model_name_number": (top("model_name", 3), "model_name:"),
    "launcher_accelerate": (top("launcher", "accelerate"), "launcher:"),
    "recipe_video_key": (top("dit_cache", {"method": "NoCache"}), "dit_cache: unknown here"),
    "recipe_launcher_args": (top("launcher_args", {}), "launcher_args: unknown here"),
    "attn_impl_flash": (arg("attn-impl", "flash_attention_2"), "model_args.attn-impl:"),
    "attn_impl_unknown": (arg("attn-impl", "fast"), "model_args.attn-impl:"),
    "moe_impl_flashinfer": (arg("moe-impl", "flashinfer"), "model_args.moe-impl:"),
    "rewrite_negative": (arg("rewrite", -1), "model_args.rewrite:"),
    "sys_deepseek_prompt_unknown": (arg("sys-deepseek-prompt", "poetry"), "model_args.sys-deepseek-prompt:"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_one_error_line(case, base, tmp_path):
    mutate, field = BAD_CONFIGS[case]
    mutate(base)
    assert_one_error(run_launcher(write_yaml(tmp_path, base), "--dry-run"), field)


def test_config_file_missing(tmp_path):
    assert_one_error(run_launcher(tmp_path / "absent.yaml", "--dry-run"), "config:")


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write_yaml(tmp_path, "world_size: 1\nmaster_port: 29611\nmodel_args: {prompt: [unclosed\n")
    res = run_launcher(path, "--dry-run")
    assert_one_error(res, "config:")
    assert "line 4" in res.stderr


def test_top_level_not_a_mapping(tmp_path):
    assert_one_error(run_launcher(write_yaml(tmp_path, "- world_size\n- 1\n"), "--dry-run"), "config:")


def test_empty_file_is_not_a_mapping(tmp_path):
    assert_one_error(run_launcher(write_yaml(tmp_path, ""), "--dry-run"), "config:")


def test_duplicate_key(tmp_path, base):
    text = yaml.safe_dump(base, sort_keys=False) + "world_size: 2\n"
    assert_one_error(run_launcher(write_yaml(tmp_path, text), "--dry-run"), "world_size: appears twice")


def test_unquoted_small_h_colon_w_is_explained(tmp_path, base):
    text = yaml.safe_dump(base, sort_keys=False).replace("image-size: 64x64", "image-size: 64:48")
    res = run_launcher(write_yaml(tmp_path, text), "--dry-run")
    assert_one_error(res, "model_args.image-size:")
    assert "base-60" in res.stderr


def test_model_dir_without_config_json(tmp_path, base, model_dir):
    (model_dir / "config.json").unlink()
    assert_one_error(run_launcher(write_yaml(tmp_path, base), "--dry-run"), "model_args.model-id:")


def test_model_config_json_invalid(tmp_path, base, model_dir):
    (model_dir / "config.json").write_text("{not json")
    assert_one_error(run_launcher(write_yaml(tmp_path, base), "--dry-run"), "model_args.model-id:")


def test_unknown_cli_option(tmp_path, base):
    assert_one_error(run_launcher_in_process(write_yaml(tmp_path, base), "--dryrun"), "arguments:")


def test_dry_run_prints_exact_command(tmp_path, model_dir, entry):
    text = f"""\
world_size: 2
master_port: 29700
entry_script: {entry}
nnodes: 2
node_rank: 1
master_addr: 10.0.0.1
env_vars:
  OMP_NUM_THREADS: 1
  NOTE: "two words"
  CFG_PARALLEL: true
model_args:
  prompt: "a red fox in the snow"
  model-id: {model_dir}
  device: cpu
  seed: 42
  moe-ep: true
  moe-tp: false
  reproduce: false
  verbose: null
  cfg-parallel: true
  multi-stream: off
  sequence-shares: off
  text-graph: on
  image-size: "64:48"
  extra-list: [1, two, true]
"""
    res = run_launcher(write_yaml(tmp_path, text), "--dry-run")
    assert res.returncode == 0, res.stderr
    expected = (f"OMP_NUM_THREADS=1 NOTE='two words' CFG_PARALLEL=true {shlex.quote(sys.executable)} "
                f"-m torch.distributed.run --nproc_per_node=2 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 "
                f"--master_port=29700 --rdzv-conf=timeout=600 {shlex.quote(str(entry))} --prompt 'a red fox in the snow' "
                f"--model-id {shlex.quote(str(model_dir))} --device cpu --seed 42 --moe-ep --cfg-parallel "
                f"--multi-stream off --sequence-shares off --text-graph on --image-size 64:48 --extra-list 1 two true")
    assert res.stdout.strip() == expected
    assert only_plan_lines(res.stderr), res.stderr


def test_npu_platform_defaults_do_not_override_yaml(tmp_path, base):
    base["model_args"]["device"] = "npu"
    base["env_vars"] = {"TASK_QUEUE_ENABLE": 1, "HCCL_EXEC_TIMEOUT": 600}
    res = run_launcher(write_yaml(tmp_path, base), "--dry-run")
    assert res.returncode == 0, res.stderr
    prefix = res.stdout.split(sys.executable)[0].split()
    assert prefix[:2] == ["TASK_QUEUE_ENABLE=1", "HCCL_EXEC_TIMEOUT=600"]
    assert "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in prefix and "HCCL_CONNECT_TIMEOUT=1200" in prefix
    assert "TASK_QUEUE_ENABLE=2" not in prefix and "HCCL_EXEC_TIMEOUT=1200" not in prefix


def test_default_config_validates(tmp_path, model_dir):
    cfg = yaml.safe_load((ROOT / "config" / "tiny_cpu.yaml").read_text())
    cfg["model_args"]["model-id"] = str(model_dir)
    res = run_launcher(write_yaml(tmp_path, cfg), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert " run_image_gen.py --prompt 'a red fox in the snow' " in res.stdout
    assert "--nproc_per_node=1 " in res.stdout and "--device cpu" in res.stdout


@pytest.mark.slow
def test_default_config_used_without_arguments():
    res = subprocess.run(["bash", str(RUN_SH), "--dry-run"], cwd=ROOT, env=launcher_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "--model-id ./models/tiny" in res.stdout


def test_dry_run_does_not_build_tiny_model(tmp_path, base):
    missing = tmp_path / "not_built_yet"
    base["build_tiny_model"] = True
    base["model_args"]["model-id"] = str(missing)
    res = run_launcher(write_yaml(tmp_path, base), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "make_tiny_model.py --out" in res.stderr
    assert not missing.exists()


def log_from(stdout: str) -> Path:
    line = next(line for line in stdout.splitlines() if line.startswith("log: "))
    return Path(line[len("log: "):])


def remove_log(log: Path) -> None:
    log.unlink(missing_ok=True)
    for parent in (log.parent, log.parent.parent, log.parent.parent.parent):
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


@pytest.mark.slow
def test_real_launch_two_cpu_ranks_returns_job_exit_code(tmp_path, base):
    base.update(world_size=2, master_port=free_port())
    base["model_args"]["flag"] = True
    res = run_launcher(write_yaml(tmp_path, base))
    log = log_from(res.stdout)
    try:
        assert res.returncode == 3, res.stdout + res.stderr
        assert log.parent == ROOT / "res" / log.parent.parent.name / "launcher_test_model"
        assert log.name.startswith("log_") and log.suffix == ".log"
        text = log.read_text()
        for rank in (0, 1):
            assert f"rank {rank} of 2 args ['--prompt', 'a red fox', " in text
        assert "'--flag'" in text
        # torchrun's ChildFailedError report stays in the log; the console gets one line naming the log
        assert "ChildFailedError" in text and "ChildFailedError" not in res.stdout + res.stderr
        assert res.stderr.strip().splitlines()[-1].startswith("error: job: rank ") and str(log) in res.stderr
    finally:
        remove_log(log)


@pytest.mark.slow
def test_ctrl_c_is_forwarded_to_the_job(tmp_path, base):
    base.update(world_size=2, master_port=free_port())
    base["model_args"]["sleep"] = True
    proc = subprocess.Popen(["bash", str(RUN_SH), str(write_yaml(tmp_path, base))], cwd=ROOT, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, deadline = [], time.monotonic() + 30
    # Count in the joined text: the workers run unbuffered, so one's text and its newline are two
    # writes and the other rank's line can land between them.
    while "".join(lines).count(" args [") < 2 and time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    log = log_from("".join(lines))
    try:
        assert proc.returncode == 130
        assert out.count("interrupted") == 2, out
    finally:
        remove_log(log)


# ---------------------------------------------------------------- the cann-recipes recipe's YAML

REAL_MODEL_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_experts": 64,
                     "moe_intermediate_size": 3072}


def recipe_yaml(model_dir) -> str:
    """Every key and value of the cann-recipes HunyuanImage-3.0 recipe's config/ep8_cfg.yaml, in its
    order (model-id pointed at `model_dir`; our own prompt)."""
    return f"""\
model_args:
  model-id: "{model_dir}"
  prompt: "a lighthouse on a cliff at dusk"
  image-size: "1024x1024"
  seed: 42
  diff-infer-steps: 50
  reproduce: true
  attn-impl: "npu"
  moe-impl: "npu_grouped_matmul"
  moe-ep: true
  verbose: 0

model_name: "hunyuan-image-3.0"
world_size: 16
master_port: 10086
entry_script: "run_image_gen.py"

env_vars:
  CFG_PARALLEL: "1"
  USE_VAE_PARALLEL: "1"
  CPU_AFFINITY_CONF: "2"
"""


def test_recipe_yaml_runs_unchanged(tmp_path, model_dir):
    (model_dir / "config.json").write_text(json.dumps(REAL_MODEL_CONFIG))
    res = run_launcher(write_yaml(tmp_path, recipe_yaml(model_dir)), "--dry-run")
    assert res.returncode == 0 and only_plan_lines(res.stderr), res.stderr
    expected = (f"CFG_PARALLEL=1 USE_VAE_PARALLEL=1 CPU_AFFINITY_CONF=2 {shlex.quote(sys.executable)} "
                f"-m torch.distributed.run --nproc_per_node=16 --nnodes=1 --node_rank=0 --master_addr=127.0.0.1 "
                f"--master_port=10086 run_image_gen.py --model-id {shlex.quote(str(model_dir))} "
                f"--prompt 'a lighthouse on a cliff at dusk' --image-size 1024x1024 --seed 42 --diff-infer-steps 50 "
                f"--reproduce --attn-impl npu --moe-impl npu_grouped_matmul --moe-ep --verbose 0")
    assert res.stdout.strip() == expected


def test_recipe_yaml_layout_is_still_checked(tmp_path, model_dir):
    """CFG_PARALLEL from its env_vars halves the 16 ranks: EP8 over 64 experts; 12 ranks do not split."""
    (model_dir / "config.json").write_text(json.dumps(REAL_MODEL_CONFIG))
    text = recipe_yaml(model_dir).replace("world_size: 16", "world_size: 12")
    assert_one_error(run_launcher(write_yaml(tmp_path, text), "--dry-run"), "moe-ep: 64 experts")


def test_recipe_cpu_affinity_wins_over_the_npu_default(tmp_path, model_dir):
    (model_dir / "config.json").write_text(json.dumps(REAL_MODEL_CONFIG))
    text = recipe_yaml(model_dir).replace("  verbose: 0\n", "  verbose: 0\n  device: npu\n")
    res = run_launcher(write_yaml(tmp_path, text), "--dry-run")
    prefix = res.stdout.split(sys.executable)[0].split()
    assert res.returncode == 0 and "CPU_AFFINITY_CONF=2" in prefix and "CPU_AFFINITY_CONF=1" not in prefix
    assert "TASK_QUEUE_ENABLE=2" in prefix


def test_model_name_names_the_log_folder(tmp_path, model_dir):
    from utils.launcher import launch
    (model_dir / "config.json").write_text(json.dumps(REAL_MODEL_CONFIG))
    job = launch.check_top(launch.load_config(write_yaml(tmp_path, recipe_yaml(model_dir))))
    assert launch.log_path(job).parent.name == "hunyuan-image-3.0"
    del job["model_name"]
    assert launch.log_path({**launch.DEFAULTS, **job}).parent.name == model_dir.name


@pytest.fixture(scope="module")
def recipe_ep2(tiny_model, tmp_path_factory):
    from recipe_checkpoint import make_recipe_checkpoint
    root = tmp_path_factory.mktemp("recipe_launch")
    return {"ep2": make_recipe_checkpoint(tiny_model, root / "ep2", 2, 1, 2),
            "int8": make_recipe_checkpoint(tiny_model, root / "int8", 2, 1, 2, int8=True)}


def test_recipe_converted_folder_layout_is_checked_before_launch(tmp_path, base, recipe_ep2):
    base.update(world_size=2)
    base["model_args"].update({"model-id": str(recipe_ep2["ep2"]), "moe-ep": True})
    res = run_launcher(write_yaml(tmp_path, base), "--dry-run")
    assert res.returncode == 0, res.stderr
    base["model_args"].update({"moe-ep": False, "moe-tp": True})
    res = run_launcher(write_yaml(tmp_path, base), "--dry-run")
    assert_one_error(res, f"error: model_args.model-id: {recipe_ep2['ep2']} is converted (by cann-recipes) for "
                          f"tp_attn=2 tp_moe=1 ep=2 but this run is tp_attn=2 tp_moe=2 ep=1")
    base["model_args"].update({"model-id": str(recipe_ep2["int8"]), "moe-ep": True, "moe-tp": False})
    res = run_launcher(write_yaml(tmp_path, base), "--dry-run")
    assert res.returncode == 0, res.stderr               # an 8-bit folder runs 8-bit without a flag
    base["model_args"]["quantize"] = "fp8"
    assert_one_error(run_launcher(write_yaml(tmp_path, base), "--dry-run"),
                     f"error: model_args.quantize: {recipe_ep2['int8']} holds int8 experts but --quantize is fp8")
    base["model_args"]["quantize"] = "int5"
    assert_one_error(run_launcher(write_yaml(tmp_path, base), "--dry-run"),
                     "error: model_args.quantize: 'int5' is not one of none, int8, fp8, int4")


def torchrun_report(exitcodes: dict) -> str:
    """torchrun's own failure report (its ChildFailedError's message) for workers {rank: exit code} that
    failed within one second: torchrun names the lowest rank as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in exitcodes.items()}
    return ChildFailedError("run_image_gen.py", failures).format_msg()


def test_the_rank_that_died_is_named_not_the_one_that_saw_it_go():
    """torchrun's report names rank 0 (a tie in whole seconds) though rank 0 only reported the lost peer:
    the launcher names rank 1, killed by SIGTERM, and exits 143 as the job's first failure did."""
    from utils.launcher.launch import job_exit_code, root_cause
    lost = "error: rank 0: a collective failed while generation 1 (text phase, denoising or VAE decode): reset\n"
    both = torchrun_report({0: 1, 1: -15})
    assert "Root Cause (first observed failure):\n[0]:" in both         # torchrun's own choice
    assert root_cause(lost + both) == (1, -15) and job_exit_code(1, lost + both) == 143
    assert root_cause(both) == (0, 1) and job_exit_code(1, both) == 1, "rank 0 failed on its own: it stays named"
    only = torchrun_report({1: -9})
    assert root_cause(lost + only) == (1, -9) and job_exit_code(1, only) == 137
    assert root_cause("no report") is None and job_exit_code(1, "no report") == 1
    earlier = torchrun_report({0: 2})
    assert root_cause(earlier + lost + both) == (1, -15), "the last report decides"
