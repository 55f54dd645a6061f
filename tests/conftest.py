import pytest


def pytest_sessionfinish(session, exitstatus):
    from harness.multirank import close_pools
    close_pools()


def pytest_collection_modifyitems(config, items):
    """The tests that wait for a background_jobs command last, so that it has the whole session to
    run beside the others (the rest keep their order)."""
    import test_device_day
    import test_selfcheck
    waiting = {test_device_day.QUICK, test_selfcheck.RUN_SH}
    items.sort(key=lambda item: item.name in waiting)


def pytest_configure(config):
    # The heap setting the product's CPU ranks make (Device.make_current), for the tests' own
    # in-process runs; the rank pools make it too (harness/multirank.py).
    from adaptor_patches.kernels.device import keep_freed_host_memory
    keep_freed_host_memory()
    config.addinivalue_line("markers", "slow: spawns ranks or a fresh interpreter (seconds each); "
                                       "`pytest -m 'not slow'` is the fast tier")
    config.addinivalue_line("markers", "compat: also run on the oldest supported stack (torch 2.7.1, "
                                       "transformers 5.2.0): `pytest -m 'not slow or compat'` there")
    config.addinivalue_line("markers", "recent_torch: needs requirements.txt's torch (the dry run's fake "
                                       "devices: utils/dry_run/job.MIN_TORCH); left out of the compat tier")


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request, tmp_path_factory):
    """{test name: background.Job} of the commands some slow tests only wait for, those of the
    session's tests, started when the session begins, one after another (tests/background.py):
    bench/device_day.sh --quick, then run.sh --selfcheck, minutes of mostly one-core steps that run
    beside the tests before theirs instead of after them."""
    import test_device_day
    import test_selfcheck
    from background import Lane
    makers = {test_device_day.QUICK: test_device_day.quick_job, test_selfcheck.RUN_SH: test_selfcheck.run_sh_job}
    selected = {item.name for item in request.session.items}
    jobs = {name: make(tmp_path_factory.mktemp(make.__module__)) for name, make in makers.items() if name in selected}
    lane = Lane(list(jobs.values()))
    yield jobs
    lane.stop()


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
    """The tiny checkpoint made for the text phase (harness/checkpoints.py)."""
    from harness.checkpoints import make_text_checkpoint
    return make_text_checkpoint(tiny_model, tmp_path_factory.mktemp("ckpt_text") / "tiny_text")


@pytest.fixture
def unpatched_upstream():
    """Upstream's own classes before and after the test, whatever it applied (model_adaptor.remove).
    Files whose tests apply the adaptor name it: `pytestmark = pytest.mark.usefixtures("unpatched_upstream")`."""
    import model_adaptor
    model_adaptor.remove()
    yield
    model_adaptor.remove()


@pytest.fixture(scope="session")
def gained_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint with attention and the MoE scaled up (gain_of), for the multi-rank
    equivalence tests and the 8-bit ones.

    At the tiny model's init scale the residual stream swamps attention and the MoE: a broken split
    still reached 47-50 dB of the single-process image (attention TP without its all-reduce 47 dB;
    with o_proj alone gained, MoE TP without its all-reduce 49.5 dB, EP rows meeting the wrong local
    expert 49.9 dB) and passed the 40 dB bound. Gained, every correct layout stays at 50-55 dB on
    both stacks while a broken split drops to 21-37 dB (tests/test_layouts.py lists them), and the
    routed experts decide enough of the image that 8-bit errors in them show (tests/test_quant_images.py).
    MOE_GAIN 16 separated a little more (broken <= 35 dB) but on the compat stack (torch 2.7.1) put
    the MoE layouts' latent error at 2.2e-2 and let bf16 noise flip a think token on TP4 layouts."""
    from harness.checkpoints import gain_of, scaled_checkpoint
    return scaled_checkpoint(tiny_model, tmp_path_factory.mktemp("gained") / "tiny", gain_of)
