import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import pytest


def pytest_sessionfinish(session, exitstatus):
    from multirank import close_pools
    close_pools()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns ranks or a fresh interpreter (seconds each); "
                                       "`pytest -m 'not slow'` is the fast tier")
    config.addinivalue_line("markers", "compat: also run on the oldest supported stack (torch 2.7.1, "
                                       "transformers 5.2.0): `pytest -m 'not slow or compat'` there")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """One tiny random checkpoint (bf16, sharded, no zero layers) shared by the session."""
    from utils.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def text_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint made for the text phase (tests/text_checkpoint.py)."""
    from text_checkpoint import make_text_checkpoint
    return make_text_checkpoint(tiny_model, tmp_path_factory.mktemp("ckpt_text") / "tiny_text")
