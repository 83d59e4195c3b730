"""The GPU code paths, run on a CUDA device simulated on the CPU (tests/support/simulated_cuda).

On the CPU every tensor is on one device and every op is synchronous, so the faults a GPU
run meets first cannot show there. On the simulated device they do, with real values:
- the static path (TP2 x PP2, packed documents) trains and logs: its batches reach the
  device (fault 1), its FLOPs and losses reduce on device tensors (faults 2 and 8a: NCCL
  takes no host tensor, on the last stage or any other);
- `--dcp` at a 4-rank layout (tp2·cp2, overlapped pull/push, recalibration on) builds and
  trains with megatron-core's GPU initialisation (the RNG tracker seeded first: fault 3),
  allocates no more than its share while building (fault 4; bytes printed beside the cost
  model's charge), waits for the device at most twice a step, at the two places allowed
  (the loss and gradient norm, the step's timings: fault 7), and every rank issues its
  collectives in an order NCCL can run (fault 8b);
- the engine through TP, CP and PP layouts, a layout switch and a layer-strategy
  micro-batch gives the CPU's losses, keeps every tensor on the device, copies host data
  without a wait, and takes the gradient norm without a float64 copy of the shard.
Fault 5 (memory terms from the kernels the run uses) is tests/planning/test_cost_kernels.py; fault 6
(device times from CUDA events) cannot show here, where the transfers are gloo's and
synchronous: the device clock is the one timing wait allowed below.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, read_loss_log, run_fresh, run_ranks
from tests.support.session_notes import note

SIM = os.path.join(REPO, "tests", "support", "simulated_cuda")
ENTRY = os.path.join(SIM, "entry.py")
SCENARIO = os.path.join(SIM, "scenario.py")
# where a --dcp step may wait for the device: reading its loss and gradient norm (which
# decide the update), and reading its timings after the last kernel
ALLOWED_SYNC_SITES = ("dcp_ext/runtime/engine.py", "dcp_ext/runtime/device_clock.py")
ALLOWED_PER_STEP = 2
NOTE = "the GPU code paths on the simulated device (tests/runtime/test_device_paths.py)"

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def shim():
    from tests.support.simulated_cuda import build_shim

    return build_shim()


def _reports(prefix: str, world: int) -> list[dict]:
    out = []
    for r in range(world):
        with open(f"{prefix}.{r}.json") as f:
            out.append(json.load(f))
    return out


def _sim_env(shim, prefix) -> dict:
    return {"SIMULATED_CUDA_SHIM": shim, "SIMULATED_CUDA_REPORT": str(prefix), "SIMULATED_CUDA": "1"}


def _failure(proc) -> str:
    """The ranks' own error lines (not torchrun's summary)."""
    import re

    text = proc.stderr + proc.stdout
    lines = [ln for ln in text.splitlines()
             if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Mismatch|Collective|NotReady)\b", ln)
             or "error: " in ln]
    return "\n".join(dict.fromkeys(lines[-12:])) or text[-3000:]


def _order_ok(reports: list[dict], steps_of) -> None:
    from tests.support.simulated_cuda import order_cycle

    group_ranks = {}
    for r in reports:
        group_ranks.update({k: v for k, v in r["group_ranks"].items()})
    n = len(steps_of(reports[0]))
    for i in range(n):
        per_rank = {rank: [tuple(c) for c in steps_of(r)[i]["collectives"]] for rank, r in enumerate(reports)}
        cycle = order_cycle(per_rank, group_ranks)
        assert cycle is None, f"step {i + 1}: ranks issue collectives in orders NCCL cannot run: {cycle}"


def _sync_line(step_syncs: list[dict]) -> str:
    from collections import Counter

    sites = Counter(f"{s['kind']} at {s['site']}" for s in step_syncs)
    return f"host syncs per step: {len(step_syncs)} (" + "; ".join(f"{n}x {k}" for k, n in sites.items()) + ")"


# ------------------------------------------------------------------ the static path
@pytest.mark.slow
def test_static_path_trains_on_the_device_as_on_the_cpu(shim, text_corpus, tmp_path):
    flags = TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--reset-attention-mask", "--reset-position-ids", "--micro-batch-size", "2",
                          "--global-batch-size", "8", "--train-iters", "2",
                          # megatron-core draws a GPU run's initial weights on the device, per
                          # TP shard, from its RNG tracker: upstream's flag starts it from the CPU's.
                          # (Untied: a tied embedding's first sync moves a CPU parameter onto the
                          # GPU in place, which a GPU does and the simulated device cannot.)
                          "--use-cpu-initialization", "--untie-embeddings-and-output-weights"]
    on_cpu = run_ranks(4, flags + ["--loss-log", str(tmp_path / "cpu.jsonl")], timeout=600)
    assert on_cpu.returncode == 0, _failure(on_cpu)
    prefix = tmp_path / "static"
    got = run_fresh(4, flags + ["--loss-log", str(tmp_path / "gpu.jsonl")], env=_sim_env(shim, prefix),
                    timeout=900, entry=ENTRY)
    assert got.returncode == 0, _failure(got)
    reports = _reports(str(prefix), 4)
    assert all(not r["faults"] for r in reports), [r["faults"] for r in reports]
    cpu, gpu = read_loss_log(str(tmp_path / "cpu.jsonl")), read_loss_log(str(tmp_path / "gpu.jsonl"))
    assert len(cpu) == len(gpu) == 2
    for a, b in zip(cpu, gpu):
        assert math.isclose(a["lm loss"], b["lm loss"], rel_tol=1e-5), (a, b)
        assert math.isclose(a["grad norm"], b["grad norm"], rel_tol=1e-4), (a, b)


# ------------------------------------------------------------------ --dcp, the real entry point
@pytest.mark.slow
def test_dcp_at_a_four_rank_layout_builds_its_share_and_waits_twice_a_step(shim, text_corpus, tmp_path):
    flags = TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                          "--dcp", "--dcp-planner", "static", "--tensor-model-parallel-size", "2",
                          "--context-parallel-size", "2", "--sequence-parallel", "--overlap-param-gather",
                          "--overlap-grad-reduce", "--dcp-global-batch-tokens", "1024", "--dcp-max-seq-len", "128",
                          "--train-iters", "3", "--dcp-recalibration", "on"]
    prefix = tmp_path / "dcp"
    got = run_fresh(4, flags, env=_sim_env(shim, prefix), timeout=900, entry=ENTRY)
    assert got.returncode == 0, _failure(got)
    assert "layout: tp2·cp2" in got.stdout, got.stdout[-2000:]
    reports = _reports(str(prefix), 4)
    assert all(not r["faults"] for r in reports), [r["faults"] for r in reports]
    for rank, r in enumerate(reports):
        b = r["build"]
        note(NOTE, f"--dcp tp2·cp2, rank {rank}: {b['allocated_total']:,} bytes allocated while building (freed or "
                   f"not; {b['peak']:,} at once at most), {b['at_rest']:,} at rest, "
                   f"{r['after_first_step']['allocated']:,} after the first step (the optimizer's moments then "
                   f"exist); the cost model charges {b['charge']:,.0f}")
        # every byte it allocated, not only the peak: a whole model built and freed before the
        # buffers would not raise the peak of a model this small
        assert b["allocated_total"] <= 1.05 * b["charge"], (rank, b)
        assert abs(r["after_first_step"]["allocated"] - b["charge"]) <= 0.05 * b["charge"], (rank, r)
    for rank, r in enumerate(reports):
        for step in r["steps"]:
            line = _sync_line(step["syncs"])
            if rank == 0:
                note(NOTE, f"--dcp tp2·cp2, iteration {step['iteration']}: {line}")
            assert len(step["syncs"]) <= ALLOWED_PER_STEP, (rank, step["iteration"], line)
            assert all(s["site"].startswith(ALLOWED_SYNC_SITES) for s in step["syncs"]), (rank, line)
    _order_ok(reports, lambda r: r["steps"])


# ------------------------------------------------------------------ the engine through layouts
@pytest.mark.slow
def test_engine_through_layouts_on_the_device_matches_the_cpu(shim, tmp_path):
    sim, cpu = tmp_path / "sim", tmp_path / "cpu"
    got = run_fresh(4, [str(sim)], env={"SIMULATED_CUDA": "1", "SIMULATED_CUDA_SHIM": shim}, timeout=900,
                    entry=SCENARIO)
    assert got.returncode == 0, _failure(got)
    ref = run_fresh(4, [str(cpu)], env={"SIMULATED_CUDA": "0"}, timeout=900, entry=SCENARIO)
    assert ref.returncode == 0, _failure(ref)
    on_device, on_cpu = _reports(str(sim), 4), _reports(str(cpu), 4)
    for rank, (d, c) in enumerate(zip(on_device, on_cpu)):
        assert not d["faults"], d["faults"]
        assert d["off_device"] == [], (rank, d["off_device"][:10])
        for a, b in zip(d["steps"], c["steps"]):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (rank, a["name"], a["loss"], b["loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (rank, a["name"])
            line = _sync_line(a["syncs"])
            if rank == 0:
                note(NOTE, f"engine, {a['name']}: loss {a['loss']:.6f} (CPU {b['loss']:.6f}), {line}")
            assert len(a["syncs"]) <= ALLOWED_PER_STEP, (rank, a["name"], line)
            assert not any("host-to-device" in s["kind"] for s in a["syncs"]), (rank, a["name"], line)
        assert d["build"]["allocated_total"] <= 1.05 * d["build"]["persistent"], (rank, d["build"])
        # the norm in float64 chunks (4096 elements here): never a float64 copy of the shard,
        # 8 bytes per element; the update's own transient stays below one too (torch's foreach
        # AdamW keeps one fp32 temporary; the first step also creates Adam's moments)
        assert max(d["norm_transient"]) < 4 * d["shard_numel"], (rank, d["norm_transient"], d["shard_numel"])
        assert max(d["optimizer_transient"][1:]) < 8 * d["shard_numel"], (rank, d["optimizer_transient"])
    _order_ok(on_device, lambda r: r["steps"])


# ------------------------------------------------------------------ the simulated device itself
PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
from tests.support import simulated_cuda as sc
sim = sc.install(os.environ["SIMULATED_CUDA_SHIM"])
import torch, torch.distributed as dist
out = {}
x = torch.randn(4, 4, device="cuda")
out["device"] = str(x.device)
w = torch.nn.Parameter(torch.randn(4, 4, device="cuda"))
(x @ w).sum().backward()
out["grad_device"] = str(w.grad.device)
try:
    x + torch.ones(4, 4)
    out["mismatch"] = None
except sc.DeviceMismatch as e:
    out["mismatch"] = str(e)
out["scalar_ok"] = float((x * torch.tensor(2.0)).sum()) is not None
n0 = len(sim.sync_log)
host = torch.ones(8).pin_memory()
host.to("cuda", non_blocking=True)
out["pinned_syncs"] = len(sim.sync_log) - n0
torch.ones(8).to("cuda")
x.sum().item()
x.tolist()
torch.cuda.synchronize()
out["kinds"] = [s["kind"] for s in sim.sync_log[n0:]]
cpu_before = torch.get_rng_state()
torch.cuda.manual_seed(7)
a = torch.randn(3, device="cuda").cpu()
torch.cuda.manual_seed(7)
b = torch.randn(3, device="cuda").cpu()
out["device_rng_repeats"] = bool(torch.equal(a, b))
out["cpu_rng_untouched"] = bool(torch.equal(cpu_before, torch.get_rng_state()))
before = torch.cuda.memory_allocated()
big = torch.empty(1000, device="cuda")
out["allocated"] = torch.cuda.memory_allocated() - before
del big
out["freed"] = torch.cuda.memory_allocated() - before
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl")
try:
    dist.all_reduce(torch.ones(2))
    out["host_collective"] = None
except sc.HostCollective as e:
    out["host_collective"] = str(e)
dist.all_reduce(torch.ones(2, device="cuda"))
gloo = dist.new_group(backend="gloo")
dist.all_reduce(torch.ones(2), group=gloo)
out["logged"] = [c[1] for c in sim.collective_log]
print(json.dumps(out))
"""


def test_the_simulated_device_sees_what_a_gpu_would(shim):
    from tests.support.helpers import free_port

    env = dict(os.environ, REPO=REPO, SIMULATED_CUDA_SHIM=shim, PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["device"] == out["grad_device"] == "cuda:0"
    assert out["mismatch"] and "aten::add" in out["mismatch"] and "<string>" in out["mismatch"]
    assert out["scalar_ok"]  # a 0-dim host tensor may meet a device tensor, as on CUDA
    assert out["pinned_syncs"] == 0
    assert out["kinds"] == ["host-to-device copy from pageable memory", "value read", "device-to-host copy",
                            "torch.cuda.synchronize"]
    assert out["device_rng_repeats"] and out["cpu_rng_untouched"]
    assert out["allocated"] == 4000 and out["freed"] == 0
    assert out["host_collective"] and "host tensor" in out["host_collective"]
    assert out["logged"] == ["c10d::allreduce_"]  # the device group's; not the host group's


def test_an_order_of_collectives_that_can_hang_is_found():
    from tests.support.simulated_cuda import order_cycle

    groups = {"world": [0, 1], "tp": [0, 1]}
    fine = {0: [("world", "c10d::alltoall_base_", None), ("tp", "c10d::allreduce_", None)],
            1: [("world", "c10d::alltoall_base_", None), ("tp", "c10d::allreduce_", None)]}
    assert order_cycle(fine, groups) is None
    crossed = {0: [("world", "c10d::alltoall_base_", None), ("tp", "c10d::allreduce_", None)],
               1: [("tp", "c10d::allreduce_", None), ("world", "c10d::alltoall_base_", None)]}
    assert order_cycle(crossed, groups) is not None
    # point to point: the k-th send from 0 to 1 meets the k-th receive on 1 from 0
    p2p = {0: [("world", "c10d::send", 1), ("tp", "c10d::allreduce_", None)],
           1: [("tp", "c10d::allreduce_", None), ("world", "c10d::recv_", 0)]}
    assert order_cycle(p2p, groups) is not None
    p2p_fine = {0: [("world", "c10d::send", 1), ("tp", "c10d::allreduce_", None)],
                1: [("world", "c10d::recv_", 0), ("tp", "c10d::allreduce_", None)]}
    assert order_cycle(p2p_fine, groups) is None
    # 1F1B's paired send and receive, one batch_isend_irecv each side: one launch, no cycle
    paired = {0: [("world", "c10d::send", 1, 7), ("world", "c10d::recv_", 1, 7)],
              1: [("world", "c10d::send", 0, 9), ("world", "c10d::recv_", 0, 9)]}
    assert order_cycle(paired, groups) is None
    unpaired = {0: [("world", "c10d::send", 1, None), ("world", "c10d::recv_", 1, None)],
                1: [("world", "c10d::send", 0, None), ("world", "c10d::recv_", 0, None)]}
    assert order_cycle(unpaired, groups) is not None
