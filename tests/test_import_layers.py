"""Imports inside adaptor_patches/ point down the layers of docs/ARCHITECTURE.md, and never in a circle.

Read statically (ast), every import counted wherever it sits (a function's lazy import is as much a
dependency as a top-level one). `LAYERS` is the order, bottom first; a module may import modules of
a lower layer, or of its own layer where that layer is a group (several files, no order between
them); the graph may hold no cycle at all. A module that is in no layer fails the test: a new file
is placed in the order when it is added.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "adaptor_patches"

# Bottom first. A tuple is one layer; its members may import each other (but not in a circle).
LAYERS = (
    ("kernels.device", "model_family"),     # model_family: which upstream model file runs a checkpoint (a leaf)
    ("kernels.int4", "kernels.quant", "kernels.collective_matmul", "kernels.torch_kernels", "kernels.cpu", "kernels.cuda", "kernels.npu",
     "kernels.__init__"),
    ("parallel.shards", "parallel.layout"),  # what one rank holds of a layer; the one Layout
    ("parallel.collectives", "parallel.context", "parallel.cfg_split", "parallel.vae_bands", "parallel.sequence",
     "parallel.ulysses"),
    ("weights.safetensors_io",),            # bytes and headers
    ("weights.int4_format",),               # what the int4 format asks of the weight path (layout rule, manifest)
    ("weights.rank_slices",),               # the per-rank slice plan
    ("weights.recipe_format",),             # the recipe's folders, as the same plan
    ("weights.quantized",),                 # quantization: a plan -> a plan
    ("weights.checkpoint",),                # the one checkpoint object
    ("weights.load",),                      # loading: orchestration
    ("moe.experts", "moe.gate", "moe.dispatch", "moe.shared_mlp"),
    ("hunyuan", "autoencoder_kl_3d", "step_cache", "denoise_watch", "text_phase", "compat", "compat_base",
     "compat_instruct", "metrics"),
)
EMPTY_PACKAGES = ("parallel.__init__", "weights.__init__", "moe.__init__")


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
    assert upward_imports(graph, layer_of()) == ["parallel.layout (layer 2) imports moe.experts (layer 11)"]
