#!/usr/bin/env bash
# The first run on a machine with an accelerator (NPU or GPU; one device is enough), one command
# of under 10 minutes:   bash bench/device_day.sh [OUT_DIR] [--device auto|npu|cuda|cpu] [--quick]
#   0 dry_run     python -m utils.dry_run: the tiny model's 2 ranks on a fake cuda / npu (no device), first
#   1 selfcheck   python -m utils.selfcheck on one device: env, every kernel and the quantized kernels (int8 /
#                 fp8 W8A16 / W8A8, int4 W4A16: npu_grouped_matmul, torch._weight_int4pack_mm) vs the
#                 reference at real shapes, the MoE layer with the side stream on/off + overlap_pct
#   2 collectives the self-check's collectives section over every device of the node (CPU: 2 gloo ranks):
#                 all_reduce / all_gather / all_to_all, and all_gather_matmul / matmul_reduce_scatter
#                 in the device's fused form vs the plain collectives (skipped with one device)
#   3 moe_layer   bench/device_layer.py: upstream eager vs patched vs the dense-GEMM floor, bf16 vs 8-bit vs int4
#   4 e2e         bench/e2e.py: the mid-size model end to end, upstream eager vs the adaptor
#   5 layouts     bench/layouts.py over every device of the node: the step time with the rows replicated
#                 vs sequence shares vs Ulysses (issue 29; skipped with one device)
#   6 instruct    the self-check's instruct section: the tiny Instruct and Instruct-Distil checkpoints
#                 editing an image on the device vs the CPU (CPU: the adaptor vs upstream eager)
#   7 text        bench/text_phase.py: the text phase's decode tokens/s on the tiny and mid Instruct
#                 checkpoints, upstream eager vs today's loop vs the new step eager vs captured (CUDA graph /
#                 torchair npugraph), host syncs per token, time to first token with and without the
#                 system-prompt cache, the real model's collectives per decode step (issue 35)
#   8 lora        bench/lora_cost.py --experts: LoRA adapters on attention, the shared MLP and every routed
#                 expert, none vs merged vs chosen per request (the device's grouped matmul), and per
#                 request vs merged (PSNR) (issue 50)
# Each step runs under `timeout` (STEP_LIMITS; DEVICE_DAY_LIMIT_S overrides them all): a stuck or
# failing step is recorded (status, exit code, seconds, log) and the next one runs. Writes
# OUT_DIR/device_day.json and OUT_DIR/device_day.md (default OUT_DIR: outputs/device_day/<UTC time>).
# --quick: small shapes and the tiny model (what tests/test_device_day.py runs on CPU); its text step
# runs the new step eager vs captured only, 16 tokens, the captured step on CPU traced by torch.compile's
# "eager" backend (fullgraph, no inductor compile: that takes minutes on a CPU).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
out="" device=auto quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:-}; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    --*) echo "error: $1: unknown option; use [OUT_DIR] [--device auto|npu|cuda|cpu] [--quick]" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
case "$device" in auto|npu|cuda|cpu) ;; *) echo "error: device: '$device' is not auto|npu|cuda|cpu; pick one" >&2; exit 2 ;; esac
out=${out:-$root/outputs/device_day/$(date -u +%Y%m%d_%H%M%S)}
mkdir -p "$out" || { echo "error: OUT_DIR: cannot create $out; pass a writable folder" >&2; exit 2; }
out=$(cd "$out" && pwd)
cd "$root" || exit 2
: > "$out/steps.tsv"

step() {            # step NAME LIMIT_S COMMAND...: run it time-boxed, record status / rc / seconds
  local name=$1 limit=${DEVICE_DAY_LIMIT_S:-$2}; shift 2
  echo "[device_day] $name (at most ${limit} s) ..." >&2
  local start end rc
  start=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( (end - start) / 1000000 ))" "$limit" >> "$out/steps.tsv"
  echo "[device_day] $name: exit $rc" >&2
}

tiny="$out/tiny_model"
[ -f "$tiny/config.json" ] || "$py" utils/make_tiny_model.py --out "$tiny" > "$out/tiny_model.log" 2>&1
# 0: the dry run first (docs/DRY_RUN.md): the tiny model's 2 ranks (MoE EP, VAE parallel) on a fake device, no
# device touched; what it predicts (no tensor off the device) the steps after it confirm on the device.
# Fake npu where torch_npu is absent (it refuses to fake a real NPU stack), else fake cuda.
dry=$("$py" -c "import importlib.util as u, sys; print('npu' if sys.argv[1] == 'npu' and u.find_spec('torch_npu') is None else 'cuda')" "$device")
step dry_run 120 "$py" -m utils.dry_run --dry-run-device "$dry" --world-size 2 --json "$out/dry_run.json" -- \
     --prompt "a red fox" --model-id "$tiny" --seed 1 --image-size 64x64 --diff-infer-steps 2 --moe-ep --vae-parallel
if [ "$quick" = 1 ]; then
  step selfcheck 180 "$py" -m utils.selfcheck --device "$device" --nproc 1 --shapes small --repeat 2 \
       --skip collectives,generation,instruct --out "$out/selfcheck"
  step collectives 180 "$py" -m utils.selfcheck --device "$device" --shapes small --collective-mib 4 \
       --skip env,kernels,moe-stream,generation,instruct --out "$out/collectives"
  step moe_layer 480 "$py" bench/device_layer.py --device "$device" --shapes small --tokens 64 --repeat 2 \
       --json "$out/moe_layer.json"
  step e2e 300 "$py" bench/e2e.py --device "$device" --model "$tiny" --size 64 --steps 2 --rounds 1 --warmup 0
  step layouts 240 "$py" bench/layouts.py --device "$device" --quick --model "$tiny"
  step instruct 300 "$py" -m utils.selfcheck --device "$device" --nproc 1 \
       --skip env,kernels,moe-stream,collectives,generation --out "$out/instruct"
  step text 120 "$py" bench/text_phase.py --device "$device" --quick --variants eager,captured \
       --json "$out/text_phase.json"
  step lora 180 "$py" bench/lora_cost.py --device "$device" --model "$tiny" --size 64 --steps 2 --rounds 1 \
       --experts --json "$out/lora.json"
else
  step selfcheck 240 "$py" -m utils.selfcheck --device "$device" --nproc 1 --skip instruct --out "$out/selfcheck"
  step collectives 180 "$py" -m utils.selfcheck --device "$device" --skip env,kernels,moe-stream,generation,instruct \
       --out "$out/collectives"
  step moe_layer 180 "$py" bench/device_layer.py --device "$device" --json "$out/moe_layer.json"
  step e2e 150 "$py" bench/e2e.py --device "$device" --steps 8 --rounds 2 --warmup 1
  step layouts 240 "$py" bench/layouts.py --device "$device" --steps 4 --rounds 1
  step instruct 180 "$py" -m utils.selfcheck --device "$device" --nproc 1 \
       --skip env,kernels,moe-stream,collectives,generation --out "$out/instruct"
  step text 240 "$py" bench/text_phase.py --device "$device" --models tiny,mid --tokens 128 \
       --parts decode,ttft,real --json "$out/text_phase.json"
  step lora 240 "$py" bench/lora_cost.py --device "$device" --experts --rounds 2 --json "$out/lora.json"
fi

"$py" - "$out" "$device" "$quick" <<'PY'
import json, sys
from pathlib import Path
out, device, quick = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds, limit = line.split("\t")
    rc = int(rc)
    status = "pass" if rc == 0 else "timeout" if rc in (124, 137) else "fail"
    log = out / f"{name}.log"
    steps[name] = {"status": status, "exit_code": rc, "seconds": round(int(seconds) / 1000, 1), "limit_s": int(limit),
                   "log": str(log), "tail": log.read_text(errors="replace").splitlines()[-(15 if rc == 0 else 60):]
                   if log.exists() else []}     # a failing step keeps more: its traceback
for name, path in (("selfcheck", out / "selfcheck" / "selfcheck.json"), ("moe_layer", out / "moe_layer.json"),
                   ("collectives", out / "collectives" / "selfcheck.json"),
                   ("instruct", out / "instruct" / "selfcheck.json"), ("text", out / "text_phase.json"),
                   ("lora", out / "lora.json")):
    if name in steps and path.is_file():
        steps[name]["result"] = json.loads(path.read_text())
summary = {"device": device, "quick": quick, "steps": steps}
(out / "device_day.json").write_text(json.dumps(summary, indent=2, default=str))
lines = [f"# device day: {device}{' (quick)' if quick else ''}", "", "| step | status | seconds | limit (s) |",
         "|---|---|---|---|"]
lines += [f"| {n} | {s['status']} | {s['seconds']} | {s['limit_s']} |" for n, s in steps.items()]
for name, s in steps.items():
    table = [l for l in s["tail"] if l.startswith("|")]
    if table:
        lines += ["", f"## {name}", ""] + table
for name, sections in (("selfcheck", ("kernels", "moe-stream")), ("collectives", ("collectives",)),
                       ("instruct", ("instruct",))):
    sc = steps.get(name, {}).get("result")
    if sc:
        lines += ["", f"## {name}", "", "| section | check | status | value | limit | detail |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['section']} | {r['check']} | {r['status']} | {r['value']} | {r['limit']} | {r['detail']} |"
                  for r in sc["results"] if r["section"] in sections]
(out / "device_day.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"\ndevice_day: {out / 'device_day.json'}")
PY
