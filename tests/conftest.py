import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """One tiny random checkpoint (bf16, sharded, no zero layers) shared by the session."""
    from utils.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny")
