"""The Python API (utils/pipeline.py): the README's example as written, and its refusals.

The README's `## Python` block runs verbatim in a fresh interpreter from the project root, on the
models/tiny that `bash run.sh` builds; its images must equal the CLI's for the same request."""
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from generation import ROOT, run_cli_in_process

pytestmark = pytest.mark.slow


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written_and_equals_the_cli(tmp_path):
    from utils.make_tiny_model import ensure_tiny_model
    ensure_tiny_model(ROOT / "models" / "tiny")                     # what `bash run.sh` builds first
    (ROOT / "outputs").mkdir(exist_ok=True)
    made = ROOT / "outputs" / "api_7.png"
    made.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", readme_example()], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("image ")]
    assert steps[:5] == [f"image 1 of 2: step {s} of 4" for s in range(5)], proc.stdout
    assert any(line.startswith("a lighthouse at dusk 7 ") for line in proc.stdout.splitlines()), proc.stdout
    cli = tmp_path / "cli.png"
    run = run_cli_in_process(["--prompt", "a lighthouse at dusk", "--model-id", str(ROOT / "models" / "tiny"),
                              "--device", "cpu", "--seed", "7", "--image-size", "auto", "--diff-infer-steps", "4",
                              "--save", str(cli)])
    assert run.returncode == 0, run.stderr[-2000:]
    assert np.array_equal(np.asarray(Image.open(made)), np.asarray(Image.open(cli))), "the API's image is not the CLI's"
    made.unlink()


def test_a_bad_request_is_refused_before_anything_runs(tiny_model):
    from utils.pipeline import Pipeline
    from utils.runtime.requests.errors import FieldError
    import model_adaptor
    try:
        pipe = Pipeline.load(tiny_model, device="cpu", image_size="64x64", diff_infer_steps=2)
        with pytest.raises(FieldError, match=r"request 2: seed: -1 is not an integer"):
            pipe.generate(["a fox", {"prompt": "a cat", "seed": -1}])
        with pytest.raises(FieldError, match=r"request 1: colour: unknown field"):
            pipe.generate([{"prompt": "a cat", "colour": "red"}])
        pipe.close()
    finally:
        model_adaptor.remove()
    with pytest.raises(FieldError, match="moe-ep: 'yes' is not True or False; pass moe_ep=True"):
        Pipeline.load(tiny_model, device="cpu", moe_ep="yes")
    with pytest.raises(FieldError, match="steps: not an option of run_image_gen.py"):
        Pipeline.load(tiny_model, steps=4)
    with pytest.raises(FieldError, match="seed: 'x' is not an integer"):
        Pipeline.load(tiny_model, seed="x")
