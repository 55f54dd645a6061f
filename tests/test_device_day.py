"""bench/device_day.sh on CPU in its quick mode: every step runs, one JSON and one table come out,
and a step that overruns its time box is recorded as such while the others still run."""
import json
import os
import shutil
import subprocess

import pytest

from background import Job, Lane
from generation import ROOT


QUICK = "test_device_day_quick_on_cpu_writes_one_json_and_a_table"


def command(out):
    return ["bash", str(ROOT / "bench" / "device_day.sh"), str(out), "--device", "cpu", "--quick"]


def device_day(out, env=None, timeout=1500):
    return subprocess.run(command(out), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def quick_job(folder) -> Job:
    """device_day.sh FOLDER/day --device cpu --quick as a background job (tests/background.py: started
    when the session begins, beside the tests before this file, when this file's test is selected)."""
    return Job("device_day", command(folder / "day"), folder, {"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_device_day_quick_on_cpu_writes_one_json_and_a_table(tmp_path, background_jobs):
    job = background_jobs.get(QUICK) or Lane([quick_job(tmp_path)]).jobs[0]
    day = job.folder / "day"
    returncode, _, stderr = job.finish(timeout=1500)
    assert returncode == 0, stderr[-2000:]
    summary = json.loads((day / "device_day.json").read_text())
    assert list(summary["steps"]) == ["dry_run", "selfcheck", "collectives", "moe_layer", "e2e", "layouts", "instruct",
                                      "text", "lora"]
    failed = {name: s for name, s in summary["steps"].items() if s["status"] != "pass"}
    assert not failed, "\n".join(f"{name}: {s['status']} (exit {s['exit_code']}):\n" + "\n".join(s["tail"])
                                  for name, s in failed.items())
    rows = summary["steps"]["moe_layer"]["result"]["rows"]
    assert {"upstream eager", "patched bf16", "patched int8 W8A16", "patched fp8 W8A16", "patched int4 W4A16"} <= set(rows)
    for name in ("selfcheck", "collectives"):         # the instruct section runs once, in its own step
        assert {r["section"] for r in summary["steps"][name]["result"]["results"]}.isdisjoint({"instruct"}), name
    checks = {r["check"] for r in summary["steps"]["selfcheck"]["result"]["results"]}
    assert "8-bit routed_experts int8 W8A16" in checks and "layer time, stream on" in checks
    assert "4-bit routed_experts int4 W4A16" in checks
    fused = {r["check"]: r["status"] for r in summary["steps"]["collectives"]["result"]["results"]}
    assert fused["all_gather_matmul, 2 ranks, uneven shares"] == "pass" and "matmul_reduce_scatter time" in fused
    assert "sequence shares" in "\n".join(summary["steps"]["layouts"]["tail"])
    instruct = {r["check"]: r for r in summary["steps"]["instruct"]["result"]["results"]}
    for name in ("instruct-edit", "distil-edit"):       # on CPU: the adaptor against upstream eager, compared
        row = instruct[f"{name} cpu-eager vs cpu"]
        assert row["status"] == "pass" and 0 < row["value"] <= row["limit"] and row["data"]["psnr_db"] < 200, row
    text = summary["steps"]["text"]["result"]       # the new decode step, eager and traced as one graph
    decode = text["decode"]["tiny"]["rows"]
    assert decode["captured"]["graph"] == "torch.compile (eager)" and decode["eager"]["graph"] == "eager", decode
    assert all(row["decoded"] == 15 and row["syncs_inside_steps"] == 0 for row in decode.values()), decode
    assert text["real"]["rows"]["ep8_cfg.yaml: CFG2 x TP8 + MoE EP8, 16 ranks, new step"]["collectives"] == 65
    table = (day / "device_day.md").read_text()
    assert "| moe_layer | pass |" in table and "dense-GEMM floor" in table and "upstream eager" in table
    assert "| collectives | matmul_reduce_scatter time | info |" in table
    assert "| instruct | pass |" in table and "| instruct | distil-edit cpu-eager vs cpu | pass |" in table
    assert "| text | pass |" in table and "| new step, captured (--text-graph on) |" in table
    lora = summary["steps"]["lora"]["result"]       # adapters of attention, the shared MLP and every expert
    assert lora["experts"] and lora["per_request_vs_merged_db"] >= 40, lora
    assert set(lora["step_s"]) == {"none", "merged", "per request: a a a", "per request: a b base"}, lora


@pytest.mark.slow
def test_a_step_past_its_time_box_is_recorded_not_fatal(tmp_path, tiny_model):
    # the session's tiny model where the script builds its own when missing: the builds take ~9 s
    # of CPU and are not what this test is about (the quick test above builds its own)
    shutil.copytree(tiny_model, tmp_path / "day" / "tiny_model")
    proc = device_day(tmp_path / "day", env={"DEVICE_DAY_LIMIT_S": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = json.loads((tmp_path / "day" / "device_day.json").read_text())["steps"]
    assert [s["status"] for s in steps.values()] == ["timeout"] * 9
    assert all(s["exit_code"] == 124 and s["seconds"] < 15 for s in steps.values())


def test_bad_arguments_are_one_line(tmp_path):
    for args, message in ((["--device", "tpu"], "error: device: 'tpu'"), (["--fast"], "error: --fast: unknown option")):
        proc = subprocess.run(["bash", str(ROOT / "bench" / "device_day.sh"), str(tmp_path / "x"), *args],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert proc.stderr.startswith(message), proc.stderr
    assert not (tmp_path / "x").exists()
