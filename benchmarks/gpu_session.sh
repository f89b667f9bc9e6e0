#!/usr/bin/env bash
# Everything the project checks on a GPU machine, in three parts of under ten minutes each.
#
#   benchmarks/gpu_session.sh check     # the gpu tests, NCCL timing against CUDA events, the NVML probe
#   benchmarks/gpu_session.sh loop      # step-time overhead on a GPU-bound own loop (A/A, A/B, baseline)
#   benchmarks/gpu_session.sh overhead  # step-time overhead on the harness, one GPU (A/A, A/B, pairs)
#   benchmarks/gpu_session.sh noise     # clean GPU step noise and the straggler replay over it
#   benchmarks/gpu_session.sh tier      # the in-process tier's steady cost on one GPU (A/B, A/A)
#   benchmarks/gpu_session.sh commit    # the step commit's host wait on NCCL (A/B, A/A), and the tier
#                                       # on the harness with it
#   benchmarks/gpu_session.sh ckpt      # DCP saves and resumes on NCCL, a corrupt newest checkpoint,
#                                       # the in-process tier's start on NCCL, two NCCL ranks on one GPU
#   benchmarks/gpu_session.sh rebuild   # the tier's abort and rebuild on NCCL, in the forward and the
#                                       # backward, against an uninterrupted run (bit for bit)
#
# Results go to $OUT (default benchmarks/out/gpu).  Where the machine has no network, wheels
# for what its Python lacks can wait in .whl/ (installed with --no-deps into /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-benchmarks/out/gpu}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
# A GPU-sized harness model: about 25 M parameters, 4,096 tokens a step.
MODEL=${MODEL:-"--dim 512 --layers 4 --heads 8 --hidden-dim 2048 --vocab 8192 --seq-len 512 --batch-size 8"}

case "${1:-check}" in
  check)
    nvidia-smi --query-gpu=name,driver_version,uuid,temperature.gpu,power.draw,clocks.sm --format=csv | tee "$OUT/device.txt"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/device.txt"
    timeout 300 $PY -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu_real.py tests/test_gpu_nvml.py \
      tests/test_gpu_cli.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
    timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_nvml.py tests/test_gpu_cli.py \
      tests/test_gpu_monitor.py tests/test_gpu_faults.py 2>&1 | tail -5
    timeout 120 $PY benchmarks/nccl_timing.py --repeats 30 2>&1 | tee "$OUT/nccl_timing.md"
    timeout 60 $PY benchmarks/gpu_probe.py --wait 2 --metrics > "$OUT/gpu_probe.json" 2>&1
    head -c 1500 "$OUT/gpu_probe.json"; echo
    ;;
  loop)
    timeout 400 $PY benchmarks/gpu_overhead.py --steps 3000 --block 20 2>&1 | tee "$OUT/gpu_overhead.md"
    ;;
  overhead)
    timeout 560 $PY benchmarks/overhead.py --nproc 1 --tp 1 --nccl-timing --harness-args "$MODEL" \
      --ab-rounds 2 --ab-steps 1000 --pairs 4 --steps 300 --skip-failopen 2>&1 | tee "$OUT/overhead.md"
    ;;
  noise)
    timeout 330 $PY benchmarks/gpu_noise.py --steps 4000 --ranks 4 --out "$OUT/gpu_noise.npz" \
      --harness-args "$MODEL" 2>&1 | tee "$OUT/noise.txt"
    (cd benchmarks && timeout 150 $PY replay.py --data "$OUT/gpu_noise.npz" --steps 2000 --trials 50 \
      2>&1 | tee "$OUT/replay_2000.md")
    (cd benchmarks && timeout 60 $PY replay.py --data "$OUT/gpu_noise.npz" --steps 100000 --trials 1 \
      2>&1 | head -3 | tee "$OUT/replay_100000.md")
    ;;
  tier)
    timeout 560 $PY benchmarks/inprocess_overhead.py --nproc 1 --pairs 4 --steps 400 \
      --harness-args "$MODEL" 2>&1 | tee "$OUT/tier_overhead.md"
    ;;
  commit)
    timeout 240 $PY benchmarks/commit_cost.py --steps 2000 --item-every 0 2>&1 | tee "$OUT/commit_cost_noitem.md"
    timeout 240 $PY benchmarks/commit_cost.py --steps 400 --block 10 --batch 65536 2>&1 | tee "$OUT/commit_cost_long.md"
    timeout 240 $PY benchmarks/commit_cost.py --steps 2000 --item-every 1 2>&1 | tee "$OUT/commit_cost_item.md"
    timeout 100 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m rankwatch.hooks.train \
      --steps 40 --log-every 10 --no-rankwatch --in-process-recovery $MODEL > "$OUT/commit_tier.log" 2>&1
    echo "tier on NCCL: exit $?"; grep -i "step 40\|error\|commit" "$OUT/commit_tier.log" | head -5
    ;;
  ckpt)
    CK=/tmp/rw-ckpt; rm -rf "$CK"; mkdir -p "$CK"
    run() {  # run <name> <steps> [harness args...]: the harness on NCCL, one rank
      local name=$1 steps=$2; shift 2
      timeout 200 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m rankwatch.hooks.train \
        --steps "$steps" --log-every 0 --no-rankwatch --checkpoint-dir "$CK/ckpt" --checkpoint-interval 10 \
        --metrics-out "$CK/$name" $MODEL "$@" > "$OUT/ckpt_$name.log" 2>&1
      echo "$name: exit $? start $($PY -c "import json; print(json.load(open('$CK/$name/rank0.json'))['start'])" 2>&1 | tail -1)"
    }
    run first 40 --in-process-recovery
    run resumed 60
    ls "$CK/ckpt"
    $PY - "$CK/ckpt/step_00000060" <<'PY'
import pathlib, sys
shards = sorted(pathlib.Path(sys.argv[1]).glob("*.distcp"))
shards[-1].write_bytes(shards[-1].read_bytes()[:100])
print("cut short:", shards[-1])
PY
    run past_corrupt 70
    grep -h "could not be loaded\|resumed from" "$OUT/ckpt_past_corrupt.log" | cut -c1-300
    ls "$CK/ckpt" "$CK/ckpt/step_00000060"
    cat > "$CK/two.py" <<'PY'
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
torch.cuda.synchronize()
print("rank", dist.get_rank(), "all_reduce", t.tolist())
dist.destroy_process_group()
PY
    timeout 90 $PY -m torch.distributed.run --standalone --nproc-per-node 2 "$CK/two.py" > "$OUT/two_on_one.log" 2>&1
    echo "two NCCL ranks on one GPU: exit $?"; grep -h -m3 "all_reduce\|Duplicate\|ncclInvalidUsage" "$OUT/two_on_one.log" | cut -c1-300
    ;;
  rebuild)
    export CUBLAS_WORKSPACE_CONFIG=:4096:8
    rb() {  # rb <name> [nccl_rebuild args...]
      timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/nccl_rebuild.py \
        --out "$OUT/rebuild_$1.json" "${@:2}" > "$OUT/rebuild_$1.log" 2>&1
      echo "$1: exit $?"
    }
    rb plain; rb forward --abort-at 15,30; rb backward --abort-at 15,30 --fault-in backward
    for n in forward backward; do
      $PY benchmarks/nccl_rebuild.py --compare "$OUT/rebuild_plain.json" "$OUT/rebuild_$n.json" | tee "$OUT/rebuild_$n.md"
    done
    ;;
esac
