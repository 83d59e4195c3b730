"""Fault injection: a save killed at each of its filesystem steps never loses the checkpoint.

`megatron/training/checkpoint/protocol.py` names every step of a save (`FAULT_POINTS`); with
`DCP_FAULT_INJECT=<step>` the process dies there (`os._exit`, as a kill -9 would). For
both checkpoint kinds (static torch_dist and `--dcp`'s fixed sharding) and three saves

    first    nothing saved yet                  -> save iteration 1
    second   iteration 1 saved                  -> save iteration 2
    resave   iterations 1 and 2 saved (tracker 2) -> save iteration 2 again, other weights
             (a relaunch of a finished job, or a resume that re-reaches a saved iteration)

the save is killed at every step it reaches, in turn; then the real loader
(`load_checkpoint` / `checkpointing_adaptive.load`) runs on the directory and must load the
newest checkpoint that completed (the new one once the commit step has passed: the tracker
for a new iteration, the rename into place for a re-save; the previous one before), with
its exact weights, iteration and consumed samples. A further save from that state must
then succeed and leave no leftovers.

Speed: each save and each load runs in a child forked from one server that has imported
torch and megatron-core (a one-rank gloo world of its own per child); a step costs its own
work, well under a second.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback

TAGS = {"first": 1.0, "second": 2.0, "resave": 22.0}  # the weights each scenario's crashed save writes
RESAVE_ONLY = ("after_aside", "after_mark_delete", "mid_delete_old", "after_delete_old")
GBS = 4


# ------------------------------------------------------------------ in the forked child
def _args(kind: str, root: str):
    from tests.conftest import TINY_MODEL

    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    flags = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", str(GBS), "--train-iters", "10",
                          "--data-path", "unused", "--save", root, "--load", root, "--use-distributed-optimizer"]
    if kind == "dcp":
        flags += ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]
    args = parse_args(flags)
    global_vars.set_args(args)
    global_vars.build_tokenizer(args)
    return args


def _static(args):
    import pretrain_gpt_dcp
    from megatron.training.initialize import initialize_model_parallel, set_random_seed
    from megatron.training.flags.records import model_parallel_for
    from megatron.training.flags.core_configs import build_lr_scheduler
    from megatron.training.flags.records import static_options_for
    from megatron.training.static.training_static import build_model_and_optimizer

    initialize_model_parallel(**model_parallel_for(args))
    set_random_seed(args.seed)
    model, optimizer, _ = build_model_and_optimizer(static_options_for(args), pretrain_gpt_dcp.model_provider)
    return model, optimizer, build_lr_scheduler(args, optimizer)


def _engine(args):
    import pretrain_gpt_dcp
    from dcp_ext.planning.layout import ReplicaType
    from dcp_ext.runtime.engine import AdaptiveEngine
    from dcp_ext.runtime.options import EngineOptions
    from dcp_ext.runtime.params.sharded_optimizer import OptimizerOptions
    from megatron.training.initialize import set_random_seed_without_parallel_state
    from megatron.training.flags.core_configs import build_lr_scheduler, transformer_config_from_args

    set_random_seed_without_parallel_state(args.seed)
    engine = AdaptiveEngine(
        [ReplicaType(1, 1, 1, (0,))],
        lambda tp, cp, pp, sp: transformer_config_from_args(args, tensor_model_parallel_size=tp,
                                                            context_parallel_size=cp,
                                                            pipeline_model_parallel_size=pp, sequence_parallel=sp),
        lambda config, pre, post, pg: pretrain_gpt_dcp.model_provider(config, pre_process=pre, post_process=post,
                                                                      pg_collection=pg),
        EngineOptions(OptimizerOptions(lr=args.lr, weight_decay=args.weight_decay, eps=args.adam_eps)))
    return engine, build_lr_scheduler(args, engine.optimizer)


class _Planner:
    state = None

    def load_planning_state(self, state):
        self.state = state


def _save(kind: str, root: str, iteration: int, tag: float) -> None:
    """Save `iteration` with every weight (and the dcp master) equal to `tag`."""
    import torch

    from megatron.training import checkpointing
    from megatron.training.checkpoint import checkpointing_adaptive
    from megatron.training.flags.records import checkpoint_config_for

    args = _args(kind, root)
    if kind == "static":
        model, optimizer, scheduler = _static(args)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.step()  # zero gradients: gives Adam its state (megatron-core saves none before a step)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(tag)
        optimizer.reload_model_params()
        checkpointing.save_checkpoint(checkpoint_config_for(args), iteration, iteration * GBS, model, optimizer, scheduler)
    else:
        engine, scheduler = _engine(args)
        engine.optimizer.set_master(torch.full_like(engine.optimizer.master(), tag))
        checkpointing_adaptive.save(checkpoint_config_for(args), iteration, iteration * GBS, engine, scheduler, {"tag": tag})


def _load(kind: str, root: str, result: str, then_save: bool) -> dict:
    """The real loader on `root`: what it loaded (iteration, consumed, the distinct weight
    values), written to `result`; then, with `then_save`, a plain save of the next iteration."""
    from megatron.training import checkpointing
    from megatron.training.checkpoint import checkpointing_adaptive
    from megatron.training.flags.records import checkpoint_config_for

    args = _args(kind, root)
    if kind == "static":
        model, optimizer, scheduler = _static(args)
        iteration, consumed = checkpointing.load_checkpoint(checkpoint_config_for(args), model, optimizer, scheduler)
        values = sorted({float(v) for p in model.parameters() for v in p.detach().unique()})
        planner_tag = None
    else:
        engine, scheduler = _engine(args)
        planner = _Planner()
        iteration, consumed = checkpointing_adaptive.load(checkpoint_config_for(args), engine, scheduler, planner)
        values = sorted({float(v) for v in engine.optimizer.master().unique()})
        planner_tag = (planner.state or {}).get("tag")
    loaded = {"iteration": iteration, "consumed": consumed, "values": values[:3], "planner_tag": planner_tag}
    with open(result, "w") as f:  # what was loaded, even if the next save fails
        json.dump(loaded, f)
    if then_save:
        nxt = iteration + 1
        if kind == "static":
            if iteration == 0:  # nothing loaded: give Adam its state as _save does
                model.zero_grad_buffer()
                optimizer.zero_grad()
                optimizer.step()
            checkpointing.save_checkpoint(checkpoint_config_for(args), nxt, nxt * GBS, model, optimizer, scheduler)
        else:
            checkpointing_adaptive.save(checkpoint_config_for(args), nxt, nxt * GBS, engine, scheduler, {"tag": planner_tag})
    return loaded


def _job(req: dict):
    """save: `iteration` with weights `tag` (killed at `fault`, if given). load: `_load`."""
    from megatron.training.initialize import initialize_distributed

    initialize_distributed("gloo")
    if req["op"] == "save":
        if req.get("fault"):
            os.environ["DCP_FAULT_INJECT"] = req["fault"]
        _save(req["kind"], req["root"], req["iteration"], req["tag"])
        return None
    return _load(req["kind"], req["root"], req["result"], req.get("then_save", False))


def _serve() -> None:
    """Fork server: one JSON request a line on stdin -> `_job` in a forked child."""
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)
    import torch  # noqa: F401
    from megatron.core import dist_checkpointing, parallel_state  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401

    import torch.distributed.checkpoint  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy  # noqa: F401
    from megatron.core.distributed import DistributedDataParallel  # noqa: F401
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401

    import pretrain_gpt_dcp  # noqa: F401
    from dcp_ext.compat import cpu_compat  # noqa: F401
    from dcp_ext.runtime.stages import model  # noqa: F401
    from dcp_ext.runtime import engine  # noqa: F401
    from megatron.training import training  # noqa: F401
    from megatron.training.checkpoint import checkpointing_adaptive
    from megatron.training.flags.records import checkpoint_config_for

    gc.freeze()  # megatron-core's save calls gc.collect(): keep the imported heap out of it
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            code = 1
            try:
                out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, 1)
                os.dup2(out, 2)
                result = _job(req)
                with open(req["result"], "w") as f:
                    json.dump(result, f)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        from tests.support.helpers import reap_forked

        code, _ = reap_forked(pid, req["timeout"], poll=0.02)
        print(json.dumps({"code": code}), flush=True)


# ----------------------------------------------------------------------- in pytest
if __name__ != "__main__":
    import pytest

    from megatron.training.checkpoint.protocol import (ASIDE_SUFFIX, DELETING_SUFFIX, FAULT_POINTS, STAGING_SUFFIX,
                                                       read_tracker)
    from tests.support.helpers import REPO, ForkServerClient

    pytestmark = pytest.mark.dist

    class Server(ForkServerClient):
        def __init__(self, work: str):
            self.work = work
            env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            env.pop("DCP_FAULT_INJECT", None)
            super().__init__(__file__, env, "fault-injection server")

        def call(self, timeout: int = 120, **req):
            log, result = (os.path.join(self.work, f"{self.count + 1}.{ext}") for ext in ("log", "json"))
            code = self.request(dict(req, log=log, result=result, timeout=timeout))["code"]
            out = open(log).read() if os.path.exists(log) else ""
            value = json.load(open(result)) if os.path.exists(result) else None
            return code, value, out

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        s = Server(str(tmp_path_factory.mktemp("fault_logs")))
        yield s
        s.close()

    def save_ok(server, kind, root, iteration, tag):
        code, _, out = server.call(op="save", kind=kind, root=root, iteration=iteration, tag=tag)
        assert code == 0, out[-3000:]

    @pytest.fixture(scope="module")
    def templates(server, tmp_path_factory):
        """Per kind, the directory each scenario starts from (saved without faults)."""
        base = tmp_path_factory.mktemp("fault_templates")
        out = {}
        for kind in ("static", "dcp"):
            first, second, resave = (str(base / f"{kind}_{s}") for s in ("first", "second", "resave"))
            os.makedirs(first)
            save_ok(server, kind, second, 1, 1.0)
            save_ok(server, kind, resave, 1, 1.0)
            save_ok(server, kind, resave, 2, 2.0)
            assert read_tracker(second) == 1 and read_tracker(resave) == 2
            out[kind] = {"first": first, "second": second, "resave": resave}
        return out

    # (scenario, iteration saved, what the loader must find before / after the commit step)
    SCENARIOS = {
        "first": (1, None, (1, TAGS["first"]), "after_tracker"),
        "second": (2, (1, 1.0), (2, TAGS["second"]), "after_tracker"),
        "resave": (2, (2, 2.0), (2, TAGS["resave"]), "after_rename"),
    }

    def _cases():
        for kind in ("static", "dcp"):
            for scenario in SCENARIOS:
                for point in FAULT_POINTS:
                    if scenario != "resave" and point in RESAVE_ONLY:
                        continue
                    yield pytest.param(kind, scenario, point, id=f"{kind}-{scenario}-{point}")

    def leftovers(root: str) -> list[str]:
        garbage = (STAGING_SUFFIX, ASIDE_SUFFIX, DELETING_SUFFIX, ".tmp")
        return sorted(n for n in os.listdir(root) if n.endswith(garbage))

    def assert_loads(server, kind, root, expect):
        """The real loader finds `expect` = (iteration, weight value), or nothing (None);
        then a save of the next iteration from this state succeeds and leaves no leftovers."""
        tracker = read_tracker(root)
        listing = sorted(os.listdir(root))
        code, got, out = server.call(op="load", kind=kind, root=root, then_save=True)
        assert got is not None, f"the loader failed on {listing}:\n{out[-3000:]}"
        if expect is None:
            assert tracker is None, listing
            assert got["iteration"] == 0 and "starting from scratch" in out, (got, out[-2000:])
        else:
            iteration, tag = expect
            assert tracker == iteration, listing
            assert got["iteration"] == iteration and got["consumed"] == iteration * GBS, got
            assert got["values"] == [tag], f"loaded the wrong copy: {got} (want {tag}); dir: {listing}"
            if kind == "dcp":
                assert got["planner_tag"] == tag, got
        assert code == 0, f"the next save failed after a crash left {listing}:\n{out[-3000:]}"
        assert leftovers(root) == [], sorted(os.listdir(root))
        assert read_tracker(root) == got["iteration"] + 1

    def test_fault_points_listed_are_the_ones_in_the_code():
        """The list the test walks is the list the save passes (a renamed or new step fails here)."""
        import re

        src = open(os.path.join(REPO, "megatron", "training", "checkpoint", "protocol.py")).read()
        assert sorted(set(re.findall(r'_fault_point\("(\w+)"\)', src))) == sorted(FAULT_POINTS)

    @pytest.mark.parametrize("kind,scenario,point", list(_cases()))
    def test_save_killed_at_each_step(server, templates, tmp_path, kind, scenario, point):
        iteration, before, after, commit = SCENARIOS[scenario]
        root = str(tmp_path / "save")
        shutil.copytree(templates[kind][scenario], root)
        code, _, out = server.call(op="save", kind=kind, root=root, iteration=iteration, tag=TAGS[scenario],
                                   fault=point)
        assert code == 17, f"the save did not reach {point} (exit {code}):\n{out[-3000:]}"
        committed = FAULT_POINTS.index(point) >= FAULT_POINTS.index(commit)
        assert_loads(server, kind, root, after if committed else before)


if __name__ == "__main__" and "--serve" in sys.argv:
    _serve()
