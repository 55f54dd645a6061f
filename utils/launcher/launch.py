"""YAML -> validated -> torchrun launcher behind run.sh. Keys: config/README.md.

Usage: run.sh [CONFIG_YAML] [--dry-run] [--plan | --no-plan] [--device-memory 64GiB]
       run.sh [CONFIG_YAML] --dry-run-device cuda|npu [--rank R]   (every rank on a fake device, no torchrun:
       utils/launcher/launch_dry_run.py, docs/DRY_RUN.md; or the YAML's top-level dry_run_device)
       (default config: config/tiny_cpu.yaml; every launch is planned first: utils/launcher/launch_plan.py)
       run.sh --selfcheck [--device D] [--nproc N] ...   (utils/selfcheck/selfcheck.py: is this node ready?)

Any bad input stops it before anything starts: one stderr line `error: <field>: <problem>; <fix>`,
exit code 2. YAML paths are relative to the project root, where the job runs. The console shows
rank 0's output (utils/runtime/engine/rank_console.py), as does res/<date>/<model name>/log_<time>.log;
each rank's whole output is in log_<time>/rank<N>.log. With nnodes > 1 the nodes' launchers meet
first (utils/launcher/node_rendezvous.py). The job's exit code is ours.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from utils.launcher.launch_config import (DEFAULTS, TINY_MODEL_SCRIPT, ConfigError, check_job_values,  # noqa: F401
                                          check_model_args, check_top, env_string, load_config, model_config,
                                          resolve_path)
from utils.launcher.node_rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, RendezvousError, meet
from utils.runtime.requests.api_key import LAUNCHER_ENV
from utils.runtime.requests.errors import FieldError
from utils.runtime.engine.rank_console import RANK_LOG_DIR
from utils.runtime.requests import request_schema as schema
from utils.runtime.requests.request_schema import join_image_names

DEFAULT_CONFIG = ROOT / "config" / "tiny_cpu.yaml"
USAGE = ("usage: run.sh [CONFIG_YAML] [--dry-run] [--plan | --no-plan] [--device-memory 64GiB] "
         "[--dry-run-device cuda|npu [--rank R]] | run.sh --selfcheck [--device D] [--nproc N]")

FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)", re.S | re.M)   # torchrun's report


def flags(margs: dict) -> list[str]:
    out = []
    for key, val in margs.items():
        spec = schema.by_flag(key)
        if isinstance(val, bool) and (key == "multi-stream" or (spec is not None and spec.kind == "choice")):
            val = "on" if val else "off"            # YAML's unquoted on / off
        if val is None or val is False or val == []:
            continue
        if isinstance(val, str) and val.startswith("-"):
            out.append(f"--{key}={val}")        # a value like "--x" would read as a flag
            continue
        out.append(f"--{key}")
        if key == "image" and isinstance(val, list):        # upstream's --image takes one comma-separated value
            out.append(join_image_names(env_string(v) for v in val))         # a comma in a name escaped
        elif isinstance(val, list):
            out.extend(env_string(v) for v in val)
        elif val is not True:
            out.append(str(val))
    return out


def exports(job: dict) -> dict:
    """env_vars, plus the NPU platform defaults the YAML and the shell do not already set."""
    env = dict(job["env_vars"])
    device = job["model_args"].get("device") or "auto"
    if device == "npu" or (device == "auto" and importlib.util.find_spec("torch_npu") is not None):
        from adaptor_patches.kernels.device import platform_env_defaults
        for name, val in platform_env_defaults("npu").items():
            if name not in env and name not in os.environ:
                env[name] = val
    return env


def key_handover(job: dict) -> tuple:
    """(model_args for the command line, environment the ranks also get, names whose values are never
    printed). A YAML `api-key` travels to the ranks in LAUNCHER_ENV, never on a command line that the
    console, the log and `ps` show: the command carries `--api-key-env LAUNCHER_ENV` instead."""
    margs, extra = dict(job["model_args"]), {}
    key, env_name = margs.get("api-key"), margs.get("api-key-env")
    if key is not None and env_name is not None:
        raise ConfigError("model_args.api-key", "given with api-key-env", "keep one of them (api-key-env keeps the "
                                                                         "key out of the YAML)")
    if key is not None:
        margs.pop("api-key")
        margs["api-key-env"] = env_name = LAUNCHER_ENV
        extra[LAUNCHER_ENV] = str(key)
    elif env_name is not None and not (os.environ.get(env_name) or job["env_vars"].get(env_name)):
        raise ConfigError("model_args.api-key-env", f"{env_name} is not set (neither in the environment nor in "
                                                    f"env_vars)", f"export {env_name}=<key> before run.sh")
    return margs, extra, {env_name} if env_name else set()


def torchrun_command(job: dict) -> list[str]:
    margs = key_handover(job)[0]
    if job["dist_timeout"] is not None and margs.get("dist-timeout") is None:
        margs["dist-timeout"] = job["dist_timeout"]
    rendezvous = [f"--rdzv-conf=timeout={rendezvous_timeout(job)}"] if job["nnodes"] > 1 else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={job['world_size']}",
            f"--nnodes={job['nnodes']}", f"--node_rank={job['node_rank']}", f"--master_addr={job['master_addr']}",
            f"--master_port={job['master_port']}", *rendezvous, job["entry_script"], *flags(margs)]


def rendezvous_timeout(job: dict) -> int:
    return job["rendezvous_timeout"] or DEFAULT_RENDEZVOUS_TIMEOUT_S


def check_port_free(job: dict) -> None:
    """On the master node, the rendezvous port must be free: taken, torchrun fails with a bare EADDRINUSE."""
    if job["node_rank"] != 0:
        return
    with socket.socket() as probe:
        # as TCPStore binds: the last job's connections in TIME_WAIT do not hold the port, a listener does
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", job["master_port"]))
        except OSError as e:
            raise ConfigError("master_port", f"{job['master_port']} is in use on this machine ({e.strerror})",
                              "pick a free port, or stop the job that holds it") from None


def shell_line(env: dict, cmd: list[str], hidden=()) -> str:
    return " ".join([f"{k}={'<hidden>' if k in hidden else shlex.quote(v)}" for k, v in env.items()] +
                    [shlex.join(cmd)])


def log_path(job: dict) -> Path:
    """res/<date>/<model_name, else model-id's last part>/log_<time>[_node<k>].log; each rank's own log
    is in the folder of the same name (rank<N>.log, utils/runtime/engine/rank_console.py)."""
    now = datetime.datetime.now()
    name = job["model_name"] or Path(os.path.normpath(job["model_args"]["model-id"])).name or "model"
    node = f"_node{job['node_rank']}" if job["nnodes"] > 1 else ""     # two nodes may share a file system
    return ROOT / "res" / now.strftime("%Y-%m-%d") / name / f"log_{now.strftime('%Y%m%d_%H%M%S')}{node}.log"


def read_chunks(fd: int):
    """fd's output until EOF. Waking every 0.2 s lets our signal handlers run promptly even when
    the kernel hands a signal to one of torch's threads instead of the main thread."""
    while True:
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            yield chunk


# torchrun's agent line when a worker fails; its ChildFailedError report follows it.
AGENT_FAILURE = re.compile(rb"elastic/multiprocessing/api\.py:\d+\] failed \(exitcode")
# the agent's warning as it stops the other workers: log only (the job's own lines say what happened)
AGENT_STOPPING = re.compile(rb"^[WI]\d{4} [^\n]*elastic/multiprocessing/api\.py:\d+\] Sending process \d+ closing "
                            rb"signal \w+\n", re.M)


class ConsoleFilter:
    """Shows the job's output but not torchrun's failure report (the log keeps everything): after
    the agent's "failed (exitcode" line the rest goes to the log only."""

    def __init__(self):
        self.hiding, self._recent = False, b""

    def visible(self, chunk: bytes) -> bytes:
        if self.hiding:
            return b""
        chunk = AGENT_STOPPING.sub(b"", chunk)
        window = self._recent + chunk
        match = AGENT_FAILURE.search(window)
        self._recent = window[-4096:]
        if not match:
            return chunk
        self.hiding = True
        end = window.find(b"\n", match.end())
        keep = (len(window) if end < 0 else end + 1) - (len(window) - len(chunk))
        return chunk[:max(keep, 0)]


AGENT_LOG_LINE = re.compile(rb"^[WIE]\d{4} [\d:.]+ \d+ \S*torch/distributed/")


class StoppingFilter:
    """The console after a signal: the ranks' own lines, not torchrun's log lines nor its
    SignalException traceback (from that traceback on, everything goes to the log only)."""

    def __init__(self):
        self.hiding, self._partial = False, b""

    def visible(self, chunk: bytes, final: bool = False) -> bytes:
        if self.hiding:
            return b""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = b"" if final else lines.pop()
        if final and lines and not lines[-1]:
            lines.pop()
        shown = []
        for line in lines:
            if line.startswith(b"Traceback (most recent call last)"):
                self.hiding = True
                break
            if not AGENT_LOG_LINE.match(line):
                shown.append(line + b"\n")
        return b"".join(shown)


def run_tee(cmd: list[str], env: dict, log) -> int:
    """Run cmd from the project root; its combined output goes to the console and the log.

    The child has its own session, so Ctrl-C or SIGTERM reaches it once, through us; a second one
    kills it. After a signal the console shows nothing more of the job (torchrun's SignalException
    report goes to the log), the ranks torchrun leaves behind are killed, and one line says so."""
    log.write(f"$ {shlex.join(cmd)}\n".encode())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    received, ranks = [], []

    def forward(signum, _frame):
        received.append(signum)
        if len(received) == 1:
            ranks.extend(child_processes(proc.pid))     # torchrun starts each rank in a session of its own
            proc.send_signal(signum)
        else:
            os.killpg(proc.pid, signal.SIGKILL)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    tail, console = b"", ConsoleFilter()
    try:
        for chunk in read_chunks(proc.stdout.fileno()):
            if received and not isinstance(console, StoppingFilter):
                console = StoppingFilter()
            sys.stdout.buffer.write(console.visible(chunk))
            sys.stdout.buffer.flush()
            log.write(chunk)
            log.flush()
            tail = (tail + chunk)[-65536:]
        rc = proc.wait()
        if isinstance(console, StoppingFilter):
            sys.stdout.buffer.write(console.visible(b"", final=True))
            sys.stdout.buffer.flush()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        left = kill_leftovers(ranks)
        name = signal.Signals(received[0]).name
        print(f"error: job: stopped by {name}{f' ({left} rank processes killed)' if left else ''}; nothing is left "
              f"running, the job's output is in {getattr(log, 'name', 'the log')}", file=sys.stderr, flush=True)
        return 128 + received[0]
    output = tail.decode(errors="replace")
    code = job_exit_code(rc, output)
    if console.hiding:
        cause = root_cause(output)
        who = f"rank {cause[0]}" if cause else "a rank"
        where = getattr(log, "name", "the log")
        rank_log = Path(where).with_suffix("") / f"rank{cause[0]}.log" if cause else None
        own = f" and in {rank_log}" if rank_log and rank_log.is_file() else ""     # its traceback too
        if own and cause[0] != 0 and code > 128:     # killed by a signal (an abort): its last words were only logged
            last = [line for line in rank_log.read_text(errors="replace").splitlines() if line.strip()][-5:]
            print("\n".join(f"[rank {cause[0]}] {line}" for line in last), file=sys.stderr, flush=True)
        print(f"error: job: {who} failed (exit {code}); its own messages are above{own}, torchrun's report is in "
              f"{where}", file=sys.stderr, flush=True)
    return code


def _start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19], fields[0]          # (parent pid, start time, state)
    except (OSError, ValueError, IndexError):
        return None


def child_processes(parent: int) -> list:
    """[(pid, start time)] of parent's children (Linux /proc; elsewhere none are known)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        info = _start_time(int(entry)) if entry.isdigit() else None
        if info and info[0] == parent:
            found.append((int(entry), info[1]))
    return found


def kill_leftovers(processes: list) -> int:
    """SIGKILL those of `processes` (from child_processes) still running: the same pid and start time."""
    killed = 0
    for pid, started in processes:
        info = _start_time(pid)
        if info and info[1] == started and info[2] != "Z":
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def root_cause(output: str):
    """(rank, exit code) of the worker that failed first, from torchrun's last failure report; None without one.

    torchrun names the failure with the earliest timestamp, in whole seconds, a tie going to the lowest
    rank: a rank that only saw a peer go (its `error: rank N: a collective failed` line) and exited before
    torchrun's next look at its workers (every 0.1 s) was named instead of the rank that died. Such a rank
    gives way to a rank of the same report that did not report a lost peer."""
    report = output[output.rfind("Failures:"):] if "Failures:" in output else ""
    others, _, root = report.partition("Root Cause")
    named = FAILED_RANK.search(root)
    if named is None:
        return None
    cause = (int(named[1]), int(named[2]))

    def lost_a_peer(rank: int) -> bool:
        return f"error: rank {rank}: a collective failed" in output
    if lost_a_peer(cause[0]):
        cause = next(((int(r), int(c)) for r, c in FAILED_RANK.findall(others) if not lost_a_peer(int(r))), cause)
    return cause


def job_exit_code(rc: int, output: str) -> int:
    """torchrun exits 1 whenever a worker fails; recover the root-cause worker's own code."""
    cause = root_cause(output) if rc == 1 else None
    code = cause[1] if cause else rc
    return 128 - code if code < 0 else code or rc


def needs_tiny_model(job: dict) -> bool:
    return job["build_tiny_model"] and not resolve_path(job["model_args"]["model-id"]).exists()


def meet_other_nodes(job: dict, log) -> bool:
    """Wait for every node's launcher (utils/launcher/node_rendezvous.py); False after its one error line."""
    timeout = rendezvous_timeout(job)
    print(f"rendezvous: node {job['node_rank']} of {job['nnodes']} waiting for the others at "
          f"{job['master_addr']}:{job['master_port']} (up to {timeout} s)", flush=True)
    log.flush()
    console_fd = os.dup(2)
    os.dup2(log.fileno(), 2)         # torch's C++ retry warnings, with their stack frames, to the log
    try:
        meet(job, timeout)
        return True
    except RendezvousError as exc:
        message = f"error: rendezvous: {exc}"
        log.write(f"{message}\n".encode())
        log.flush()
        os.dup2(console_fd, 2)
        print(message, file=sys.stderr, flush=True)
        return False
    finally:
        os.dup2(console_fd, 2)
        os.close(console_fd)


def launch(job: dict, env: dict, config_path: Path) -> int:
    cmd = torchrun_command(job)
    model_id = job["model_args"]["model-id"]
    path = log_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"log: {path}", flush=True)
    _, secret_env, hidden = key_handover(job)
    child_env = {**os.environ, **env, **secret_env, RANK_LOG_DIR: str(path.with_suffix(""))}
    with open(path, "ab") as log:
        log.write(f"# {shell_line(env, cmd, hidden)}\n".encode())
        if needs_tiny_model(job):
            rc = run_tee([sys.executable, TINY_MODEL_SCRIPT, "--out", model_id], child_env, log)
            if rc:
                print(f"error: build_tiny_model: {TINY_MODEL_SCRIPT} failed (exit {rc}); see {path}", file=sys.stderr)
                return rc
            check_job_values(job, model_config(model_id, False), config_path, child_env)
        if job["nnodes"] > 1 and not meet_other_nodes(job, log):
            return 1
        return run_tee(cmd, child_env, log)


def parse_argv(argv: list[str]) -> tuple:
    """(config path, options): --dry-run, --plan (print the plan and stop), --no-plan, --device-memory X,
    --dry-run-device K, --rank R."""
    options = {"dry_run": False, "plan": False, "no_plan": False, "device_memory": None, "dry_run_device": None,
               "rank": None}
    rest, args = [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--dry-run", "--plan", "--no-plan"):
            options[arg[2:].replace("-", "_")] = True
        elif arg in ("--device-memory", "--dry-run-device", "--rank"):
            if not args:
                raise ConfigError(arg, "needs a value", USAGE)
            options[arg[2:].replace("-", "_")] = args.pop(0)
        else:
            rest.append(arg)
    if any(a.startswith("-") for a in rest) or len(rest) > 1:
        raise ConfigError("arguments", f"cannot use {' '.join(rest)!r}", USAGE)
    return (Path(rest[0]) if rest else DEFAULT_CONFIG), options


def run(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv and argv[0] == "--selfcheck":
        from utils.selfcheck import selfcheck
        return selfcheck.main(argv[1:])
    path, options = parse_argv(argv)
    from utils.launcher import launch_dry_run as fake
    fake.check_kind(options["dry_run_device"], "--dry-run-device")
    job = check_top(load_config(path))
    kind = options["dry_run_device"] or job["dry_run_device"]
    rank = fake.check_rank(options["rank"], job["world_size"] * job["nnodes"], kind)
    if kind and options["dry_run"]:
        raise ConfigError("--dry-run", f"given with a dry run on a fake {kind}", "use one: --dry-run prints the "
                                                                                "torchrun command, the fake device runs the job")
    config = check_model_args(job["model_args"], job["build_tiny_model"])
    if kind and isinstance(job["model_args"], dict):
        job["model_args"]["device"] = kind      # checked and planned as the fake device's job
    key_handover(job)                   # the YAML's key refusals, in its own words, before the job check
    layout = check_job_values(job, config, path, {**os.environ, **job["env_vars"]})
    env = exports(job)
    if not options["dry_run"] and not options["plan"] and not kind:
        check_port_free(job)
    if not options["no_plan"]:          # last: the cheap checks speak first, each alone on the console
        from utils.launcher.launch_plan import plan_job
        plan_job(job, layout, options)
        if options["plan"]:
            return 0
    if kind:
        if needs_tiny_model(job):
            fake.build_tiny_model(job)
        margs = {k: v for k, v in job["model_args"].items() if k not in ("api-key", "api-key-env")}   # nothing served
        return fake.run_dry(job, kind, rank, flags(margs))
    if not options["dry_run"]:
        return launch(job, env, path)
    if needs_tiny_model(job):
        print(f"note: would first run {TINY_MODEL_SCRIPT} --out {job['model_args']['model-id']}", file=sys.stderr)
    _, secret_env, hidden = key_handover(job)
    if secret_env:
        print(f"note: api-key: handed to the ranks in the environment variable {LAUNCHER_ENV} (not shown); export it "
              f"before running this command yourself", file=sys.stderr)
    print(shell_line(env, torchrun_command(job), hidden))
    return 0


def main(argv: list[str]) -> int:
    try:
        return run(argv)
    except FieldError as e:            # ConfigError and the request schema's refusals
        message, code = str(e), 2
    except KeyboardInterrupt:
        message, code = "launcher: interrupted before the job started; run it again", 130
    except Exception as e:
        message, code = f"launcher: unexpected {type(e).__name__}: {e}; please report it", 2
    print("error: " + " ".join(message.split()), file=sys.stderr)
    return code
