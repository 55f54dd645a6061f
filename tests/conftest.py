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
def tiny_instruct(tmp_path_factory):
    """A tiny HunyuanImage-3.0-Instruct checkpoint (utils/make_tiny_model.py --instruct)."""
    from utils.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("ckpt_instruct") / "tiny_instruct", variant="instruct")


@pytest.fixture(scope="session")
def tiny_distil(tmp_path_factory):
    """A tiny HunyuanImage-3.0-Instruct-Distil checkpoint (utils/make_tiny_model.py --distil)."""
    from utils.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("ckpt_distil") / "tiny_distil", variant="distil")


@pytest.fixture(scope="session")
def text_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint made for the text phase (tests/text_checkpoint.py)."""
    from text_checkpoint import make_text_checkpoint
    return make_text_checkpoint(tiny_model, tmp_path_factory.mktemp("ckpt_text") / "tiny_text")


ATTENTION_GAIN = 32.0


@pytest.fixture(scope="session")
def gained_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with every o_proj scaled by ATTENTION_GAIN, for the multi-rank equivalence tests.

    At the tiny model's init scale the residual stream swamps attention: with the attention-TP
    all-reduce removed the image still reached 47 dB of the single-process one. Scaled, a broken
    split drops to ~21 dB while a correct one stays near 50 dB, so end-to-end runs tell them apart."""
    from generation import scaled_checkpoint
    return scaled_checkpoint(tiny_model, tmp_path_factory.mktemp("gained") / "tiny",
                             lambda key: ATTENTION_GAIN if key.endswith("self_attn.o_proj.weight") else 1)
