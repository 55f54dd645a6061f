"""Nothing below the entry points reads the environment (docs/ARCHITECTURE.md, "Rules"; the
exceptions outside its reach are listed there too).

A static check (the source's syntax tree, not a run): no module under adaptor_patches/ reads
`os.environ` / `os.getenv` (any alias of `os`, or the names imported from it). The entry points read
their environment and pass what matters down (utils/runtime/requests/job_check.py's `env`: the process's, or
the launcher's YAML `env_vars`); tests inject what they need into the objects they build.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READERS = {"environ", "environb", "getenv", "getenvb"}
# module path (relative to the project root) -> why it may read the environment. Keep it empty.
ALLOWED: dict = {}


def environment_reads(source: str) -> list:
    """[(line, text)] of every read of the process environment in `source`."""
    tree = ast.parse(source)
    os_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names if alias.name == "os"}
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            reads += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in READERS]
        elif (isinstance(node, ast.Attribute) and node.attr in READERS and isinstance(node.value, ast.Name)
              and node.value.id in os_names):
            reads.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(reads)


def test_no_module_under_adaptor_patches_reads_the_environment():
    found = {}
    for path in sorted((ROOT / "adaptor_patches").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        reads = environment_reads(path.read_text())
        if reads and name not in ALLOWED:
            found[name] = reads
    assert not found, f"environment read below the entry points (pass the value down instead): {found}"
    assert set(ALLOWED) <= {str(p.relative_to(ROOT)) for p in (ROOT / "adaptor_patches").rglob("*.py")}


@pytest.mark.parametrize("source,expected", [
    ("import os\nx = os.environ.get('A')\n", [(2, "os.environ")]),
    ("import os as o\ndef f():\n    return o.getenv('A')\n", [(3, "o.getenv")]),
    ("from os import environ\n", [(1, "from os import environ")]),
    ("from os import getenv as g, path\n", [(1, "from os import getenv")]),
    ("import os\nos.path.join('a', 'b')\nenv = {'environ': 1}\n", []),
])
def test_the_check_finds_every_spelling_of_a_read(source, expected):
    assert environment_reads(source) == expected
