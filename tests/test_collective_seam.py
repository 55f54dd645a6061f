"""Every collective of a forward goes through the kernel set's communication seam
(adaptor_patches/kernels/collectives.py), so the planner's traffic lines and the code read one description.

Read statically (ast), as tests/test_import_layers.py reads imports: a forward-path module
(FORWARD_PATH) names no torch.distributed collective, whether called, passed (P2POp(dist.isend, ...)),
looked up by getattr or imported by name. Every other module of adaptor_patches/ that does (the
control-plane agreements) is listed in the seam's docstring, so a reader of that one file sees
every collective the adaptor runs.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "adaptor_patches"
SEAM = "kernels/collectives.py"
FORWARD_PATH = ("hunyuan.py", "moe", "parallel/ulysses.py", "parallel/cfg_split.py", "parallel/vae_bands.py",
                "parallel/sequence.py", "autoencoder_kl_3d.py", "lora_rows.py")
COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "P2POp", "barrier", "monitored_barrier",
    "_functional_collectives", "nn",            # the functional and autograd collectives' modules
}
DISTRIBUTED = "torch.distributed"


def direct_collectives(source: str) -> list:
    """(line, name) of each torch.distributed collective the source names outside the seam. Its
    aliases: every `import torch.distributed as x` / `from torch import distributed as x` anywhere in
    the file, and `dist` (the project's name for it, also as a parameter: step_cache.round_record)."""
    tree = ast.parse(source)
    aliases, found = {"dist"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {alias.asname for alias in node.names if alias.name == DISTRIBUTED and alias.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(DISTRIBUTED):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name in COLLECTIVES
                      or node.module.split(".")[2:3] == ["_functional_collectives"]]

    def is_distributed(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in aliases
        return ast.unparse(node) == DISTRIBUTED

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and is_distributed(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and is_distributed(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in COLLECTIVES):
            found.append((node.lineno, node.args[1].value))
    return sorted(found)


def modules() -> dict:
    """{path relative to adaptor_patches/: source} of every module."""
    return {path.relative_to(PACKAGE).as_posix(): path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py"))}


def is_forward_path(name: str) -> bool:
    return any(name == entry or name.startswith(entry + "/") for entry in FORWARD_PATH)


def test_forward_path_modules_reach_torch_distributed_only_through_the_seam():
    sources = modules()
    forward = [name for name in sources if is_forward_path(name)]
    assert len(forward) >= len(FORWARD_PATH), f"FORWARD_PATH names a file that is gone: {forward}"
    offenders = {name: direct_collectives(sources[name]) for name in forward}
    assert {name: calls for name, calls in offenders.items() if calls} == {}, (
        "forward-path collectives go through the kernel set (kernels/collectives.py), where the traffic "
        "recorder and a device's own forms see them")


def test_every_direct_collective_outside_the_seam_is_a_control_plane_line_of_its_docstring():
    sources = modules()
    control_plane = ast.get_docstring(ast.parse(sources[SEAM])).split("Control plane")[1]
    direct = {name for name, source in sources.items() if name != SEAM and direct_collectives(source)}
    assert direct, "the control-plane agreements (text tokens, cancel flag, ...) call torch.distributed"
    assert {name for name in direct if name not in control_plane} == set()


def test_the_check_sees_each_way_of_naming_a_collective():
    source = "\n".join([
        "import torch",
        "import torch.distributed as d",
        "from torch import distributed as td",
        "from torch.distributed import all_to_all_single, get_rank",
        "d.all_reduce(x)",
        "torch.distributed.broadcast(x, src=0)",
        "ops = [td.P2POp(td.isend, x, 1)]",
        "getattr(dist, 'all_gather_single', None)",
        "d.get_world_size(); d.group.WORLD; x.all_reduce; get_rank()",
    ])
    assert direct_collectives(source) == [(4, "all_to_all_single"), (5, "all_reduce"), (6, "broadcast"),
                                          (7, "P2POp"), (7, "isend"), (8, "all_gather_single")]
