"""run.sh's YAML -> a validated job: every key, value and file it names checked before anything starts.

Keys: config/README.md. Refusals raise ConfigError (`field: problem; fix`); utils/launcher/launch.py prints
it as one `error:` line and exits 2.
"""
from __future__ import annotations

import difflib
import os
import re
import socket
from pathlib import Path

from utils.runtime.requests import request_schema as schema
from utils.runtime.requests.request_schema import FieldError, is_int

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_SCRIPT = "utils/make_tiny_model.py"
REQUIRED_KEYS = ("world_size", "master_port", "entry_script", "model_args")
DEFAULTS = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "env_vars": {}, "build_tiny_model": False,
            "dist_timeout": None, "model_name": None, "launcher": "torchrun", "device_memory": None,
            "rendezvous_timeout": None, "dry_run_device": None}
TOP_KEYS = REQUIRED_KEYS + tuple(DEFAULTS)
# Keys the cann-recipes-infer launcher knows for its other models: refused, saying why. The keys of
# its HunyuanImage-3.0 YAML are ours or in DEFAULTS (model_name; launcher: torchrun, its default).
RECIPE_OTHER_KEYS = {
    "launcher_args": "accelerate's arguments in the cann-recipes launcher; this launcher always starts torchrun",
    "dit_cache": "a DiT cache of the cann-recipes video models; HunyuanImage-3.0 has no such option",
    "sparse": "sparse attention of the cann-recipes video models; HunyuanImage-3.0 has no such option",
}
MAX_YAML_DEPTH = 50              # a config is a few levels deep; 5000 would exhaust Python's stack
MAX_YAML_NODES = 20000           # nodes after alias expansion: a few lines of aliases can mean 2^26
ATTN_IMPLS = ("sdpa", "eager", "npu")
MOE_IMPLS = ("eager", "npu_grouped_matmul")
UNSUPPORTED_IMPLS = {"flash_attention_2": "the flash-attn package's kernel has no attention-TP path here",
                     "flashinfer": "the FlashInfer package's MoE has no TP / EP path here"}
REWRITE_PROMPTS = ("universal", "text_rendering")
SWITCHES = ("moe-tp", "moe-ep", "cfg-parallel", "vae-parallel", "reproduce", "noise-on-cpu", "skip-existing", "serve",
            "infer-align-image-size")
SCALARS = (str, int, float, bool)
ENV_SWITCHES = ("CFG_PARALLEL", "USE_VAE_PARALLEL")
FLAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*\Z")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class ConfigError(FieldError):
    """A refusal of the YAML: str() is `field: problem; fix`."""


def load_config(path: Path) -> dict:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """Refuses a key given twice, naming it by its path (e.g. model_args.seed); nesting beyond
        MAX_YAML_DEPTH and documents that aliases expand beyond MAX_YAML_NODES."""
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            if self.depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError("config", f"nested deeper than {MAX_YAML_DEPTH} levels (line {mark.line + 1})",
                                  "write a flat `key: value` file as in config/tiny_cpu.yaml")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_document(self, node):
            check_expansion(node)
            self._check_unique(node, "")
            return super().construct_document(node)

        def _check_unique(self, node, prefix):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, value_node in node.value:
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
                    if key in seen:
                        raise ConfigError(f"{prefix}{key}", f"appears twice (line {key_node.start_mark.line + 1})",
                                          "keep one entry")
                    seen.add(key)
                    self._check_unique(value_node, f"{prefix}{key}.")
            elif isinstance(node, yaml.SequenceNode):
                for item in node.value:
                    self._check_unique(item, prefix)

    def expanded_size(node, sizes: dict) -> int:
        """Nodes under `node` once every alias is expanded (a shared node counts each time); each
        node's count kept in `sizes`, so a few lines of aliases cost a few steps, not 2^26."""
        if id(node) not in sizes:
            children = node.value if isinstance(node, yaml.SequenceNode) else \
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
            sizes[id(node)] = 1 + sum(expanded_size(child, sizes) for child in children)
        return sizes[id(node)]

    def check_expansion(root) -> None:
        """Refuse a document that aliases expand beyond MAX_YAML_NODES, naming the deepest key whose
        value alone does (e.g. model_args.seed), else the whole config."""
        sizes = {}
        if expanded_size(root, sizes) <= MAX_YAML_NODES:
            return
        path, node, line = [], root, root.start_mark.line + 1
        while isinstance(node, yaml.MappingNode):
            big = [(key, value) for key, value in node.value if sizes[id(value)] > MAX_YAML_NODES]
            if not big:
                break
            key, node = big[0]
            path.append(key.value if isinstance(key, yaml.ScalarNode) else str(key))
            line = key.start_mark.line + 1
        what = "its value" if path else "it"
        raise ConfigError(".".join(path) or "config", f"aliases expand {what} to more than {MAX_YAML_NODES} values "
                          f"(line {line})", "write the values out; drop the aliases")

    from adaptor_patches.weights.regular_files import read_regular_text, regular_file_problem
    problem = regular_file_problem(path)
    if problem:                                 # a named pipe would keep the read waiting for good
        raise ConfigError("config", f"'{path}' {problem}", "pass a YAML file (see config/)")
    if not path.is_file():
        raise ConfigError("config", f"'{path}' does not exist", "pass an existing YAML file (see config/)")
    try:
        data = yaml.load(read_regular_text(path), Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("config", f"YAML syntax error in {path}{where}: {getattr(e, 'problem', None) or e}",
                          "fix the YAML there (indentation, ':' after keys, quotes)") from None
    except UnicodeDecodeError:
        raise ConfigError("config", f"{path} is not UTF-8 text", "save it as UTF-8 YAML") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"the top level of {path} is {type(data).__name__}, not a mapping",
                          "write `key: value` lines as in config/tiny_cpu.yaml")
    return data


def need_int(value, field: str, lo: int, hi: int | None = None, fix: str = "") -> None:
    span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"{value!r} is not an integer", fix or f"use an integer {span}")
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(field, f"{value} is not {span}", fix or f"use an integer {span}")


def resolve_path(value: str) -> Path:
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else ROOT / path


def env_string(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


DRY_RUN_KINDS = ("cuda", "npu")     # utils/dry_run/job.KINDS


def check_kind(value, field: str):
    """None, or the dry-run device `value` names; a ConfigError naming `field` otherwise."""
    if value is None:
        return None
    if value not in DRY_RUN_KINDS:
        raise ConfigError(field, f"{value!r} is not one of {'|'.join(DRY_RUN_KINDS)}",
                          "use cuda or npu (the fake device the dry run runs on), or leave it out")
    return value


def check_top(cfg: dict) -> dict:
    for key in cfg:
        if key in RECIPE_OTHER_KEYS:
            raise ConfigError(str(key), f"unknown here: {RECIPE_OTHER_KEYS[key]}", "remove it")
        if key not in TOP_KEYS:
            close = difflib.get_close_matches(str(key), TOP_KEYS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(TOP_KEYS)}"
            raise ConfigError(str(key), "unknown top-level key", fix)
    for key in REQUIRED_KEYS:
        if key not in cfg:
            raise ConfigError(key, "missing", f"add `{key}:` (see config/README.md)")
    job = {**DEFAULTS, **cfg}
    need_int(job["world_size"], "world_size", 1, fix="set the ranks per node, e.g. 1, 2 or 8")
    need_int(job["master_port"], "master_port", 1, 65535, fix="pick a free TCP port, e.g. 29611")
    need_int(job["nnodes"], "nnodes", 1, fix="set the number of nodes, 1 for one machine")
    need_int(job["node_rank"], "node_rank", 0, fix="set this node's index, 0 on the master node")
    if job["node_rank"] >= job["nnodes"]:
        raise ConfigError("node_rank", f"{job['node_rank']} is not below nnodes={job['nnodes']}",
                          f"use a node_rank in 0..{job['nnodes'] - 1} or raise nnodes")
    addr = job["master_addr"]
    if not isinstance(addr, str) or not addr or any(c.isspace() or c == "\0" for c in addr):
        raise ConfigError("master_addr", f"{addr!r} is not a host name or IP", "use e.g. 127.0.0.1 or node0")
    if job["nnodes"] > 1 and "master_addr" not in cfg:
        raise ConfigError("master_addr", f"missing with nnodes={job['nnodes']} (the default 127.0.0.1 reaches no "
                                         f"other node)", "set it to the master node's host name or IP on every node")
    try:
        socket.getaddrinfo(addr, job["master_port"])
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError("master_addr", f"{addr!r} does not resolve ({e})", "use the master node's IP or a "
                                                                             "host name this machine resolves") from None
    if job["dist_timeout"] is not None:
        schema.JOB["dist_timeout"].check(job["dist_timeout"], field="dist_timeout")
    if job["rendezvous_timeout"] is not None:
        need_int(job["rendezvous_timeout"], "rendezvous_timeout", 1,
                 fix="use whole seconds, e.g. 600 (the default), the longest one node may wait for the others")
    script = job["entry_script"]
    if not isinstance(script, str) or not script or not resolve_path(script).is_file():
        raise ConfigError("entry_script", f"{script!r} is not a file under {ROOT}",
                          "point it at an existing script, e.g. run_image_gen.py")
    if resolve_path(script).suffix != ".py":
        raise ConfigError("entry_script", f"{script!r} is not a Python file (.py)",
                          "point it at a Python script, e.g. run_image_gen.py")
    if not isinstance(job["build_tiny_model"], bool):
        raise ConfigError("build_tiny_model", f"{job['build_tiny_model']!r} is not true/false", "use true or false")
    name = job["model_name"]
    if name is not None and (not isinstance(name, str) or not name.strip() or name.strip(".") == ""
                             or "/" in name or os.sep in name or "\0" in name):
        raise ConfigError("model_name", f"{name!r} cannot name a log folder",
                          "use a plain name such as hunyuan-image-3.0, or leave it out (the model-id's last part)")
    if job["launcher"] != "torchrun":
        raise ConfigError("launcher", f"{job['launcher']!r} is not supported; this launcher always starts torchrun",
                          "use launcher: torchrun or leave it out")
    job["env_vars"] = check_env_vars(job["env_vars"])
    check_kind(job["dry_run_device"], "dry_run_device")
    return job


def check_env_vars(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("env_vars", f"is {type(value).__name__}, not a mapping", "write `NAME: value` lines")
    for name, val in value.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise ConfigError(f"env_vars.{name}", "is not an environment variable name",
                              "use letters, digits and '_', not starting with a digit")
        if not isinstance(val, SCALARS):
            raise ConfigError(f"env_vars.{name}", f"value {val!r} is not a scalar", "use a string or a number")
        if "\0" in env_string(val):
            raise ConfigError(f"env_vars.{name}", f"value {ascii(val)} contains a NUL byte",
                              "remove it (an environment variable cannot hold one)")
    env = {name: env_string(val) for name, val in value.items()}
    from adaptor_patches.parallel.layout import LayoutError, env_flag
    for name in ENV_SWITCHES:
        try:
            env_flag(name, env)
        except LayoutError as exc:
            raise ConfigError(f"env_vars.{name}", *str(exc).split(": ", 1)[1].split("; ", 1)) from None
    return env


def check_model_args(margs, build_tiny: bool) -> dict | None:
    """model_args as YAML values: flag names, value types, each value by the request schema
    (utils/runtime/requests/request_schema.py), the switches and choices; the checkpoint's config.json (None if
    it is yet to be built). The job's rules come after: check_job_values."""
    if not isinstance(margs, dict):
        raise ConfigError("model_args", f"is {type(margs).__name__}, not a mapping",
                          "write `flag-name: value` lines under model_args")
    for key, val in margs.items():
        check_flag(key, val)

    def get(key, default=None):
        return default if margs.get(key) is None else margs[key]

    for key, val in margs.items():            # the run's own rules (utils/runtime/requests/request_schema.py)
        spec = schema.by_flag(key)
        if spec is not None and val is not None and spec.cli:
            if key == "image-size" and is_int(val):
                raise ConfigError("model_args.image-size", f"{val!r} is not auto, HxW or H:W (YAML reads an unquoted "
                                  f"H:W of small numbers as one base-60 number)", 'use a quoted size such as "1024x1024"')
            try:
                spec.check(val)
            except FieldError as exc:
                raise exc.renamed(f"model_args.{key}") from None
    for key, val in margs.items():            # a NUL byte cannot reach the ranks' command line
        if any(isinstance(v, str) and "\0" in v for v in (val if isinstance(val, list) else [val])):
            raise ConfigError(f"model_args.{key}", f"{ascii(val)} contains a NUL byte",
                              "remove it (a command line cannot carry one)")
    for key in SWITCHES:
        if not isinstance(get(key, False), bool):
            raise ConfigError(f"model_args.{key}", f"{margs[key]!r} is not true/false", "use true or false")
    for key, allowed in (("attn-impl", ATTN_IMPLS), ("moe-impl", MOE_IMPLS), ("sys-deepseek-prompt", REWRITE_PROMPTS)):
        value = get(key, allowed[0])
        if value not in allowed:
            why = f" ({UNSUPPORTED_IMPLS[value]})" if value in UNSUPPORTED_IMPLS else ""
            fix = f"use one of {', '.join(allowed)}"
            if key in ("attn-impl", "moe-impl"):
                fix += " (on an NPU the fused NPU kernels run with any of them)"
            raise ConfigError(f"model_args.{key}", f"{value!r} is not one of {'|'.join(allowed)}{why}", fix)
    if get("multi-stream") not in (None, True, False, "on", "off"):
        raise ConfigError("model_args.multi-stream", f"{margs['multi-stream']!r} is not on|off", "use on or off")
    return model_config(get("model-id"), build_tiny)


def check_job_values(job: dict, config: dict | None, config_path: Path | None, env: dict):
    """run_image_gen's own job check (utils/runtime/requests/job_check.py) on the YAML's values, as every
    rank will run it (less the tokenizer's prompt lengths), then the checkpoint as rank 0 will check
    it; return the job's Layout. `config` None: the tiny checkpoint is yet to be built."""
    from adaptor_patches.parallel.layout import LayoutError
    from utils.runtime.requests.job_args import from_model_args
    from utils.runtime.requests.job_check import check_job
    margs = job["model_args"]
    args = from_model_args(margs, resolve=resolve_path)
    try:
        checked = check_job(args, world_size=job["world_size"] * job["nnodes"], env=env, writes_outputs=True,
                            inputs=[("config YAML", config_path)], resolve=resolve_path, model_ready=config is not None)
        if config is not None:
            check_converted(resolve_path(margs["model-id"]), checked.layout, margs.get("adaptor") != "shims",
                            margs.get("quantize"))
    except FieldError as exc:
        raise exc.renamed(f"model_args.{exc.field}") from None
    except LayoutError as exc:
        raise _config_error(exc) from None
    return checked.layout


def check_flag(key, val) -> None:
    if not isinstance(key, str) or not FLAG_NAME.match(key):
        fix = f"write it with dashes: {key.replace('_', '-')}" if isinstance(key, str) and "_" in key else \
            "use a flag name like diff-infer-steps, without '--'"
        raise ConfigError(f"model_args.{key}", "is not a flag name", fix)
    if val is None or isinstance(val, SCALARS) or (isinstance(val, list) and all(isinstance(v, SCALARS) for v in val)):
        return
    raise ConfigError(f"model_args.{key}", f"a {type(val).__name__} value cannot be a flag",
                      "use a string, number, true/false, null or a list of those")


def model_config(model_id, build_tiny: bool) -> dict | None:
    """The checkpoint's config.json, or None when build_tiny_model will create the directory."""
    field = "model_args.model-id"
    if not isinstance(model_id, str) or not model_id.strip():
        raise ConfigError(field, "missing or not a path", "set model-id: <checkpoint dir>")
    path = resolve_path(model_id)
    if not path.exists():
        if not build_tiny:
            raise ConfigError(field, f"'{model_id}' does not exist",
                              "point it at a checkpoint dir, or set build_tiny_model: true to make a tiny one there")
        if not (ROOT / TINY_MODEL_SCRIPT).is_file():
            raise ConfigError("build_tiny_model", f"{TINY_MODEL_SCRIPT} is missing", "point model-id at a checkpoint")
        return None
    open_model(path, regular_files_only=True)
    if not (path / "config.json").is_file():
        raise ConfigError(field, f"'{model_id}' is not a directory with a config.json",
                          "point it at a HunyuanImage-3 checkpoint dir")
    return open_model(path).config


def open_model(path: Path, regular_files_only: bool = False):
    """The checkpoint opened once (adaptor_patches/weights/checkpoint.py), as the ranks open it;
    `regular_files_only`: only its files checked to be regular ones (nothing read)."""
    from adaptor_patches.parallel.layout import LayoutError
    from adaptor_patches.weights.checkpoint import check_regular_files, open_checkpoint
    try:
        return check_regular_files(path) if regular_files_only else open_checkpoint(path)
    except LayoutError as e:
        raise _config_error(e) from None


def _config_error(e) -> "ConfigError":
    field, _, rest = str(e).partition(": ")
    problem, _, fix = rest.partition("; ")
    field = f"model_args.{field}" if field in ("model-id", "quantize") else field
    return ConfigError(field, problem, fix or "see config/README.md")


def check_converted(model_dir: Path, layout, per_rank: bool, quantize=None) -> None:
    """The checkpoint as the ranks will check it: converted (ours or the cann-recipes converter's)
    for this layout, every index and shard header sound, an original's shapes as config.json says;
    8-bit experts with their scales, and model_args.quantize agreeing with an 8-bit folder."""
    checkpoint = open_model(model_dir)
    if checkpoint.has_weights:
        checkpoint.check_for_run(layout, 0, per_rank, quantize)
    else:                               # a config.json alone is planned, not checked (the ranks refuse it)
        checkpoint.check_run(layout, 0, per_rank)
