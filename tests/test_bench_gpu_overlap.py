"""bench/gpu_overlap.py stays runnable: its overlap arithmetic, and a CPU smoke of the whole script."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_overlap  # noqa: E402


def _kernel(stream, ts, dur):
    return {"cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlap_pct_from_a_synthetic_trace(tmp_path):
    # main stream busy 0-100, side stream busy 50-80 and 90-120: 40 us concurrent of side's 60.
    events = [_kernel(7, 0, 60), _kernel(7, 60, 40), _kernel(13, 50, 30), _kernel(13, 90, 30),
              {"cat": "cpu_op", "ts": 0, "dur": 500, "args": {}}]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    streams = gpu_overlap.kernels_by_stream(trace)
    assert streams[7] == [[0, 100]] and gpu_overlap.busy(streams[13]) == 60
    assert gpu_overlap.overlap_of(streams[7], streams[13]) == 40


@pytest.mark.slow
def test_cpu_smoke_of_the_prepared_script(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_overlap.py"), "--device", "cpu", "--small",
                           "--repeat", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_overlap.json").read_text())
    assert result["outputs_identical_on_off"] is True
    assert result["stream_on_ms"] > 0 and result["shared_only_ms"] > 0
