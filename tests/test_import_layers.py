"""Imports inside adaptor_patches/ point down the layers of docs/ARCHITECTURE.md, and nowhere in the
project do modules import each other in a circle.

Read statically (ast), every import counted wherever it sits (a function's lazy import is as much a
dependency as a top-level one). `LAYERS` is the order, bottom first; a module may import modules of
a lower layer, or of its own layer where that layer is a group (several files, no order between
them); the graph may hold no cycle at all. A module that is in no layer fails the test: a new file
is placed in the order when it is added.

The cycle check covers the whole project's own Python (PROJECT: adaptor_patches/, utils/, harness/,
bench/, model_adaptor.py, run_image_gen.py; not the upstream files staged beside them, .upstream_staged,
nor tests/): a circle between two tools (utils/runtime/requests/request_schema.py and upstream_taylor.py
had one) fails as one inside the adaptor does.

utils/runtime/ is three subpackages by job, bottom first (RUNTIME): requests/ (what a request and a job
are, their checks), http/ (the server), engine/ (the ranks); each imports only its own or a lower one,
and no module sits beside them.

Between the roots, imports point down too: the product (adaptor_patches/, utils/, model_adaptor.py,
run_image_gen.py) imports neither harness/ nor bench/ nor tests/; harness/ (what the tests and the
benchmarks share) imports neither of them; tests/ imports no benchmark and a benchmark nothing of tests/.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "adaptor_patches"
PROJECT = ("adaptor_patches", "utils", "harness", "bench", "model_adaptor.py", "run_image_gen.py")

# Bottom first. A tuple is one layer; its members may import each other (but not in a circle).
LAYERS = (
    ("kernel_names",),                      # the kernel layer's names, torch-free (the launcher's schema reads them)
    ("kernels.device", "kernels.fake_device", "model_family"),    # fake_device: a dry run's streams and events     # model_family: which upstream model file runs a checkpoint (a leaf)
    ("kernels.int4", "kernels.quant", "kernels.collectives", "kernels.collective_matmul", "kernels.fixed_shape", "kernels.torch_kernels", "kernels.cpu", "kernels.cuda", "kernels.npu",
     "kernels.__init__", "kernels.decode_graph"),
    ("parallel.shards", "parallel.layout"),  # what one rank holds of a layer; the one Layout
    ("parallel.context", "parallel.cfg_split", "parallel.vae_bands", "parallel.sequence",
     "parallel.ulysses"),
    ("weights.regular_files",),             # every file read before the weights: a regular one
    ("weights.safetensors_io",),            # bytes and headers
    ("weights.int4_format",),               # what the int4 format asks of the weight path (layout rule, manifest)
    ("weights.rank_slices",),               # the per-rank slice plan
    ("weights.recipe_format",),             # the recipe's folders, as the same plan
    ("weights.quantized",),                 # quantization: a plan -> a plan
    ("weights.config_shapes",),             # what config.json implies: size fields, every tensor's shape
    ("weights.checkpoint", "weights.lora"),  # the one checkpoint object; LoRA adapters merged as it is read
    ("weights.load",),                      # loading: orchestration
    ("moe.experts", "moe.gate", "moe.dispatch", "moe.shared_mlp"),
    ("forward_context",),                   # a call's state, read by the features below (torch-free)
    ("hunyuan", "lora_rows", "autoencoder_kl_3d", "step_cache", "denoise_watch", "previews", "text.phase", "text.sampling",
     "text.kv_reuse", "text.decode", "text.rows", "text.batch", "image_batch", "compat", "compat_base",
     "compat_instruct", "metrics"),
)
EMPTY_PACKAGES = ("parallel.__init__", "weights.__init__", "moe.__init__", "text.__init__")


def module_names() -> dict:
    """{dotted name inside the package: path}; a package's own file is `pkg.__init__`."""
    return {".".join(path.relative_to(PACKAGE).with_suffix("").parts): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict) -> set:
    """The package's modules that `name` imports (relative or absolute, at any depth of the file)."""
    package = name.split(".")[:-1]
    found = set()

    def resolve(parts: list):
        dotted = ".".join(parts)
        package_file = f"{dotted}.__init__" if dotted else "__init__"
        return dotted if dotted in modules else package_file if package_file in modules else None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".")[1:] for alias in node.names if alias.name.split(".")[0] == PACKAGE.name]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".") if node.module else []
            if node.level:
                base = package[:len(package) - node.level + 1] + module
            elif module[:1] == [PACKAGE.name]:
                base = module[1:]
            else:
                continue
            # `from pkg import submodule` depends on the submodule; `from module import name` on the module
            targets = [base + [alias.name] if resolve(base + [alias.name]) else base for alias in node.names]
        else:
            continue
        for parts in targets:
            target = resolve(parts)
            assert target is not None, f"{name} imports {'.'.join(parts)}, which the package does not hold"
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of() -> dict:
    layers = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    layers.update(dict.fromkeys(EMPTY_PACKAGES, -1))
    return layers


def upward_imports(graph: dict, layers: dict) -> list:
    return sorted(f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
                  for name, targets in graph.items() for target in targets if layers[target] > layers[name])


def cycles(graph: dict) -> list:
    """Every cycle's modules, one list per strongly connected component of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ---------------------------------------------------------------- the whole project

def staged_upstream() -> set:
    """Paths (from the root) utils/stage_upstream.sh copied in (its stamp lists them): upstream's, not ours."""
    stamp = ROOT / ".upstream_staged"
    lines = stamp.read_text(encoding="utf-8").splitlines() if stamp.is_file() else []
    return set(lines[2:]) if lines[:1] and lines[0].startswith("commit ") else set()


def project_modules() -> dict:
    """{dotted name: path} of the project's own modules (PROJECT); a package's own file is `pkg.__init__`."""
    staged, paths = staged_upstream(), []
    for entry in PROJECT:
        path = ROOT / entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return {".".join(path.relative_to(ROOT).with_suffix("").parts): path for path in paths
            if path.relative_to(ROOT).as_posix() not in staged}


def project_imports(name: str, source: str, modules: dict) -> set:
    """The project's modules that module `name` (its text: `source`) imports, at any depth of the file.
    Absolute names under PROJECT's packages, relative ones, and the bare names a script imports from
    its own folder (a bench script's `from e2e import ...`: bench/ is on sys.path when it runs by path)."""
    package = name.split(".")[:-1]
    roots = {entry.removesuffix(".py") for entry in PROJECT}

    def resolve(parts: list):
        dotted = ".".join(parts)
        return dotted if dotted in modules else f"{dotted}.__init__" if f"{dotted}.__init__" in modules else None

    def absolute(parts: list) -> list:
        if parts[0] in roots:
            return parts
        return package + parts if resolve(package + parts[:1]) else []      # a sibling, or not ours

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bases = [absolute(alias.name.split(".")) for alias in node.names]
            targets = [resolve(base) for base in bases if base]
        elif isinstance(node, ast.ImportFrom):
            module = node.module.split(".") if node.module else []
            base = package[:len(package) - node.level + 1] + module if node.level else absolute(module)
            if not base:
                continue
            # `from pkg import submodule` depends on the submodule; `from module import name` on the module
            targets = [resolve(base + [alias.name]) or resolve(base) for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target is not None and target != name)
    return found


def project_graph() -> dict:
    modules = project_modules()
    return {name: project_imports(name, path.read_text(encoding="utf-8"), modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    layers = layer_of()
    unplaced = sorted(set(module_names()) - set(layers))
    assert not unplaced, f"{unplaced}: add them to LAYERS (and docs/ARCHITECTURE.md's layer list)"
    gone = sorted(set(layers) - set(module_names()))
    assert not gone, f"{gone} are in LAYERS but not in adaptor_patches/"


def test_imports_point_down():
    graph, layers = import_graph(), layer_of()
    upward = upward_imports(graph, layers)
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The two checks on a made-up graph: a cycle inside a group, an import up the order."""
    graph = {"kernels.cpu": {"kernels.npu"}, "kernels.npu": {"kernels.cpu"}, "parallel.layout": {"moe.experts"},
             "moe.experts": set()}
    assert cycles(graph) == [["kernels.cpu", "kernels.npu"]]
    assert upward_imports(graph, layer_of()) == ["parallel.layout (layer 3) imports moe.experts (layer 14)"]


def test_no_import_cycle_anywhere_in_the_project():
    found = cycles(project_graph())
    assert not found, f"import cycles: {found}"


def test_the_project_check_covers_every_root_and_leaves_upstream_out():
    modules = project_modules()
    for name in ("model_adaptor", "run_image_gen", "utils.runtime.requests.request_schema", "bench.e2e",
                 "adaptor_patches.kernels.cpu", "utils.selfcheck.checks.__init__"):
        assert name in modules, name
    assert not any(name.startswith(("tests.", "hunyuan_image_3.")) for name in modules)
    if (ROOT / "utils" / "import_utils.py").is_file():          # upstream's, staged beside ours
        assert "utils.import_utils" not in modules


def test_the_project_check_finds_the_old_request_schema_upstream_taylor_circle():
    """upstream_taylor.with_step_cache_flags once read the schema's defaults by a lazy
    `from utils.runtime.requests.request_schema import JOB` while request_schema imported upstream_taylor's
    UPSTREAM_DEFAULTS: put that import back and the check names the two."""
    modules, graph = project_modules(), project_graph()
    name = "utils.runtime.requests.upstream_taylor"
    old = (modules[name].read_text(encoding="utf-8")
           + "\n\ndef old():\n    from utils.runtime.requests.request_schema import JOB\n")
    graph[name] = project_imports(name, old, modules)
    assert cycles(graph) == [["utils.runtime.requests.request_schema", name]]


def test_the_project_imports_are_read_as_python_resolves_them():
    modules = {name: None for name in ("bench.e2e", "bench.throughput", "utils.__init__", "utils.runtime.__init__",
                                       "utils.runtime.requests.errors", "adaptor_patches.kernels.cpu",
                                       "adaptor_patches.kernels.__init__", "model_adaptor")}
    source = ("import torch\nfrom e2e import ensure_model\nimport model_adaptor\n"
              "def f():\n    from utils.runtime.requests import errors\n    from adaptor_patches.kernels import cpu\n"
              "    from utils import _LazyModule\n    from numpy import e2e\n")
    assert project_imports("bench.throughput", source, modules) == {
        "bench.e2e", "model_adaptor", "utils.runtime.requests.errors", "adaptor_patches.kernels.cpu", "utils.__init__"}
    assert project_imports("adaptor_patches.kernels.cpu", "from . import __init__\nfrom .. import kernels\n",
                           modules) == {"adaptor_patches.kernels.__init__"}


# ---------------------------------------------------------------- utils/runtime/'s jobs

RUNTIME = ("requests", "http", "engine")    # utils/runtime/'s subpackages, bottom first (docs/ARCHITECTURE.md)


def runtime_part(name: str):
    """The RUNTIME subpackage a module of utils/runtime/ is in ("" for one beside them), None outside it."""
    parts = name.split(".")
    if parts[:2] != ["utils", "runtime"] or name == "utils.runtime.__init__":
        return None
    return parts[2] if len(parts) > 3 else ""


def runtime_upward_imports(graph: dict) -> list:
    return sorted(f"{name} ({runtime_part(name)}) imports {target} ({runtime_part(target)})"
                  for name, targets in graph.items() if runtime_part(name) in RUNTIME
                  for target in targets if runtime_part(target) in RUNTIME
                  and RUNTIME.index(runtime_part(target)) > RUNTIME.index(runtime_part(name)))


def test_every_runtime_module_is_in_one_of_its_subpackages():
    unplaced = sorted(name for name in project_modules() if runtime_part(name) not in (None, *RUNTIME))
    assert not unplaced, f"{unplaced}: put each under one of utils/runtime/{{{','.join(RUNTIME)}}}/ by its job"
    for part in RUNTIME:
        assert f"utils.runtime.{part}.__init__" in project_modules(), part


def test_runtime_imports_point_down_its_subpackages():
    upward = runtime_upward_imports(project_graph())
    assert not upward, "imports against utils/runtime/'s order (requests <- http <- engine):\n" + "\n".join(upward)


def test_the_runtime_check_sees_an_upward_import():
    graph = {"utils.runtime.requests.job_check": {"utils.runtime.engine.outputs", "utils.runtime.requests.errors"},
             "utils.runtime.http.image_server": {"utils.runtime.engine.rank_loop", "utils.runtime.requests.batching"},
             "utils.runtime.engine.many_images": {"utils.runtime.http.image_server"}}
    assert runtime_upward_imports(graph) == [
        "utils.runtime.http.image_server (http) imports utils.runtime.engine.rank_loop (engine)",
        "utils.runtime.requests.job_check (requests) imports utils.runtime.engine.outputs (engine)"]


# ---------------------------------------------------------------- between the roots

TEST_MODULES = {path.stem for path in (ROOT / "tests").glob("*.py")}


def top_imports(path: Path) -> list:
    """(line, dotted name) of every import in the file, at any depth; `from a import b` gives a.b."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_product_and_the_harness_import_no_tests_and_no_benchmark():
    staged = staged_upstream()
    files = [path for entry in ("adaptor_patches", "utils", "harness", "model_adaptor.py", "run_image_gen.py")
             for path in ([ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py")))
             if path.relative_to(ROOT).as_posix() not in staged]
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in files for line, name in top_imports(path)
             if name.split(".")[0] in ("tests", "bench") or (path.parts[-2] != "harness" and
                                                              name.split(".")[0] == "harness")]
    assert not wrong, wrong


def test_tests_and_benchmarks_import_each_other_not():
    """Issue 49: tests import no benchmark, benchmarks no test module (not even a hardware double:
    what needs one is counted by a test)."""
    wrong = [f"tests/{path.name}:{line} imports {name}" for path in sorted((ROOT / "tests").glob("*.py"))
             for line, name in top_imports(path) if name.split(".")[0] == "bench"]
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for line, name in top_imports(path):
            parts = name.split(".")
            if parts[0] == "tests" or parts[0] in TEST_MODULES:
                wrong.append(f"bench/{path.name}:{line} imports {name}")
    assert not wrong, wrong


def sys_path_edits(path: Path) -> list:
    """The lines of `path` that change sys.path (insert, append, extend, a slice assigned), code only."""
    def on_sys_path(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and on_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) and on_sys_path(t.value)
                                                  for t in node.targets):
            lines.append(node.lineno)
    return lines


def test_a_script_run_by_path_puts_the_root_on_sys_path_once_and_nothing_else_edits_it():
    """bench/'s scripts, the tests' --write / --record scripts and utils' converters are run by path:
    one commented line each puts the repo root on sys.path. Tests get it from pytest.ini's pythonpath."""
    staged = staged_upstream()
    roots = [*PROJECT, "tests"]
    files = [path for entry in roots
             for path in ([ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py")))
             if path.relative_to(ROOT).as_posix() not in staged]
    wrong = []
    for path in files:
        edits, text = sys_path_edits(path), path.read_text(encoding="utf-8").splitlines()
        said = all("#" in text[line - 1] or "#" in text[line - 2] for line in edits)
        if len(edits) > 1 or not said:
            wrong.append(f"{path.relative_to(ROOT)}: lines {edits}" + ("" if said else " (no comment)"))
    assert not wrong, wrong
