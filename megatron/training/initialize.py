"""Process start-up: torch.distributed, the CPU redirects, megatron-core's parallel state, seeds.

Works under torchrun (env:// rendezvous, NCCL on GPUs, gloo on CPUs) and as a plain
single process (`python pretrain_gpt_dcp.py`), which then forms a world of one.

`--distributed-timeout-minutes` reaches every process group the run creates: the default
one here, megatron-core's model-parallel groups (`initialize_model_parallel`), the adaptive
runtime's (`GroupRegistry`, through `groups.set_group_timeout`). A rank that stops
answering then ends the job within that time; each rank's heartbeat (startup/liveness.py, started
by `pretrain` right after this) tells the survivors which rank it was.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from dcp_ext.compat import cpu_compat, mcore_compat
from megatron.training.flags.argument_errors import ArgumentError
from megatron.training.startup.cpu_binding import bind_cpu_rank
from megatron.training.errors import TrainingError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(backend: str, timeout_minutes: int = 10) -> None:
    if dist.is_initialized():
        return
    cpu_compat.install()
    mcore_compat.install()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # before gloo starts its threads, which then inherit the binding
        bind_cpu_rank()
    try:
        dist.init_process_group(backend=backend, timeout=timeout, **_restart_safe_store(timeout))
    except RuntimeError as e:  # torch's DistNetworkError / DistStoreError
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "?")
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise ArgumentError(f"MASTER_PORT {port} on {addr} is already in use (another job on this machine?): "
                                "set MASTER_PORT to a free port, or pass torchrun --master-port") from None
        if "timed out" in text.lower() or "timeout" in text.lower():
            joined = _clients_joined(text)
            raise TrainingError(
                f"rank {rank} waited {timeout_minutes} min at MASTER_ADDR {addr}:{port} for the other ranks of "
                f"WORLD_SIZE={world}{joined} and they never came: start every rank (torchrun --nproc_per_node starts "
                "them all), check WORLD_SIZE, MASTER_ADDR/MASTER_PORT and the network "
                "(--distributed-timeout-minutes sets how long to wait)") from None
        raise
    from dcp_ext.runtime.stages import groups

    groups.set_group_timeout(timeout)  # the adaptive runtime's groups wait as long as the default one


def _clients_joined(text: str) -> str:
    """', 1 of 2 joined' from torch's store timeout message, when it says."""
    import re

    m = re.search(r"(\d+)/(\d+) clients joined", text)
    return f", {m.group(1)} of {m.group(2)} joined" if m else ""


def shutdown_distributed() -> None:
    """After a run that ended well: tear the process groups down now, while the interpreter is
    whole. Left to interpreter exit, their destructors race the runtime's teardown, and one
    rank in a few hundred (gloo, 2 loaded cores) died with `terminate called without an
    active exception` (SIGABRT) after its last line, failing a finished job under torchrun."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _restart_safe_store(timeout) -> dict:
    """Under torchrun, a restarted worker group (--max-restarts) reuses the agent's store,
    and gloo then reads the dead attempt's addresses (connectFullMesh: connection refused,
    torch 2.13). Namespace the keys by restart count so every attempt rendezvous afresh."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"dcp/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def initialize_model_parallel(tp: int, pp: int, cp: int, timeout_minutes: int) -> None:
    """megatron-core's model-parallel groups for the static layout (TP, PP, CP), every group
    waiting at most --distributed-timeout-minutes."""
    from megatron.core import parallel_state

    timeout = datetime.timedelta(minutes=timeout_minutes)
    with groups_created_with_timeout(timeout):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            distributed_timeout_minutes=timeout_minutes,  # megatron-core's default is 30
        )


@contextlib.contextmanager
def groups_created_with_timeout(timeout: datetime.timedelta):
    """Every `torch.distributed.new_group` called inside without a timeout gets `timeout`:
    megatron-core passes its `distributed_timeout_minutes` to all its groups but one (0.16.1
    creates the expert-data-parallel gloo group without it, so it would wait 30 minutes)."""
    create = dist.new_group

    def new_group(*args, **kwargs):
        if len(args) < 2 and kwargs.get("timeout") is None:  # new_group(ranks, timeout, ...)
            kwargs["timeout"] = timeout
        return create(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = create


def set_random_seed(seed: int, offset_by_pipeline_rank: bool = True) -> None:
    """Megatron's seeding: one seed per pipeline stage, model-parallel RNG tracker seeded."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if offset_by_pipeline_rank and parallel_state.model_parallel_is_initialized():
        seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def set_random_seed_without_parallel_state(seed: int) -> None:
    """Seeds for the adaptive runtime, which has no global layout (the engine seeds
    megatron-core's model-parallel RNG tracker per step, for the step's TP rank)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def print_rank_0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def print_rank_last(*args, **kwargs) -> None:
    """Megatron prints the iteration line from the last rank (it holds the loss)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(*args, **kwargs, flush=True)
