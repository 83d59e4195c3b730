"""A CUDA device simulated on the CPU: the GPU code paths run, with real values, in CI.

Why it exists: on the CPU every tensor is on the same device and every op is synchronous,
so the faults a GPU run meets first (a host tensor meeting a device tensor, a collective
on a host tensor, an unseeded CUDA RNG tracker, a whole model materialised on the device,
a host round trip per layer) cannot be seen by CPU tests. Here a process that calls
`install()` before importing torch sees one CUDA device, "cuda:0", that behaves as a GPU
does where these faults show:

- tensors on it are CPU tensors wrapped as `SimulatedCudaTensor` (device cuda:0, real
  values), so whole training steps run and can be compared with the CPU;
- an op that mixes a device tensor with a host tensor (other than a 0-dim host scalar,
  as CUDA allows) raises `DeviceMismatch`, naming the op and the call site;
- a collective on a host tensor over a group that would be NCCL raises `HostCollective`
  (the run's NCCL backend is gloo underneath; groups asked for with backend "gloo" are
  host groups and take host tensors);
- every host synchronisation is recorded with its call site (`syncs()`): `.item()`,
  `float()`/`bool()` of a device tensor, `.cpu()`/`.tolist()`, device-to-host copies,
  blocking or pageable host-to-device copies, data-dependent shapes (`nonzero`, boolean
  masks), `torch.cuda.synchronize()`, stream and event synchronisation;
- `torch.cuda`'s RNG is a generator of its own, separate from the CPU one, so megatron-core's
  RNG tracker must be seeded as on a GPU; device random ops draw from it;
- the device's allocated bytes and peak are tracked (`torch.cuda.memory_allocated()`,
  `max_memory_allocated()`, `reset_peak_memory_stats()`), so what a rank materialises
  is measured;
- the order in which each rank issues collectives per communicator is recorded
  (`collectives()`), so a test can check NCCL's rule that ranks sharing communicators
  issue them in one consistent order (`order_cycle`).

The C++ part (`shim.cpp`, built once per torch version into `build/simulated_cuda/`)
registers a do-nothing CUDA device guard and CUDA hooks, which the autograd engine and
`pin_memory()` need; it must be loaded before torch initialises, hence `install()` first.
Nothing here is imported by the product: it is test infrastructure.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import traceback
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SHIM_SOURCE = os.path.join(HERE, "shim.cpp")

_state = None  # the process's _Simulation once installed


class DeviceMismatch(RuntimeError):
    """A host tensor met a device tensor in one op (a GPU raises here too)."""


class HostCollective(RuntimeError):
    """A collective on a host tensor over a group that would be NCCL on a GPU."""


class EventNotReady(RuntimeError):
    """An event's time read before anything synchronised with it (CUDA: 'device not ready')."""


# --------------------------------------------------------------------- the shim
def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")  # without importing torch
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("simulated_cuda: torch is not installed")
    return list(spec.submodule_search_locations)[0]


def build_shim(cache_dir: str | None = None) -> str:
    """Compile shim.cpp against the installed torch (once; ~2 s) and return the library's path."""
    torch_dir = _torch_dir()
    with open(SHIM_SOURCE, "rb") as f:
        key = hashlib.sha1(f.read() + torch_dir.encode()).hexdigest()[:12]
    cache_dir = cache_dir or os.path.join(REPO, "build", "simulated_cuda")
    out = os.path.join(cache_dir, f"shim-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    lib = os.path.join(torch_dir, "lib")
    cmd = [os.environ.get("CXX", "g++"), "-O1", "-shared", "-fPIC", "-std=c++20", "-w",
           "-I", os.path.join(torch_dir, "include"), SHIM_SOURCE, "-L", lib, "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{lib}", "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"simulated_cuda: building the shim failed:\n{done.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------- install
def install(shim: str | None = None, memory_bytes: int = 141 * 2**30) -> "_Simulation":
    """Make this process see one simulated CUDA device. Call before `import torch`."""
    global _state
    if _state is not None:
        return _state
    if "torch" in sys.modules:
        raise RuntimeError("simulated_cuda.install() must run before torch is imported")
    ctypes.CDLL(shim or build_shim(), mode=ctypes.RTLD_GLOBAL)
    import torch  # noqa: F401  (initialises with the shim's hooks)

    _state = _Simulation(memory_bytes)
    _state.start()
    return _state


def active() -> bool:
    return _state is not None


def state() -> "_Simulation":
    if _state is None:
        raise RuntimeError("simulated_cuda is not installed in this process")
    return _state


def syncs() -> list[dict]:
    """Every host synchronisation so far: {"kind", "site", "op"} in order."""
    return list(state().sync_log)


def collectives() -> list[tuple]:
    """(group name, op) of every device collective this rank issued, in issue order."""
    return list(state().collective_log)


def violations() -> list[str]:
    """Faults recorded without raising (inside torch's own threads), one line each."""
    return list(state().violation_log)


# --------------------------------------------------------------------- call sites
_SKIP = (os.sep + "torch" + os.sep, os.sep + "simulated_cuda" + os.sep, os.sep + "contextlib.py",
         os.sep + "functools.py", os.sep + "threading.py", "<frozen")


def call_site(skip_megatron_core: bool = False) -> str:
    """`path:line (function)` of the innermost frame outside torch and this module; when it
    is in megatron-core, also the innermost frame of this repository that led there."""
    frame = sys._getframe(1)
    first = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(s in path for s in _SKIP):
            here = f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if first is None:
                first = here
                if (os.sep + "megatron" + os.sep + "core" + os.sep) not in path:
                    return first
            elif (os.sep + "megatron" + os.sep + "core" + os.sep) not in path:
                return f"{first} via {here}"
        frame = frame.f_back
    return first or "?"


def _short(path: str) -> str:
    for marker in (os.sep + "site-packages" + os.sep, REPO + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


# --------------------------------------------------------------------- the simulation
class _Simulation:
    def __init__(self, memory_bytes: int):
        import torch

        self.torch = torch
        self.memory_bytes = memory_bytes
        self.generator = torch.Generator()  # the device's RNG, apart from the CPU's
        self.generator.manual_seed(0)
        self.sync_log: list[dict] = []
        self.collective_log: list[tuple] = []
        self.violation_log: list[str] = []
        self.host_groups: set[str] = set()  # names of groups created with backend "gloo"
        self.allocated = 0
        self.peak = 0
        self.allocated_total = 0  # every byte ever allocated, freed or not
        self._storages: dict[int, list] = {}  # storage id -> [bytes, wrappers alive]
        self._lock = threading.Lock()
        self.last_sync = 0.0  # perf_counter of the last host wait for the device
        self.raise_faults = True
        self.group_ranks: dict[str, list[int]] = {}  # group name -> its global ranks
        self.batch = None  # the id of the batch_isend_irecv being issued, if any
        self.batches = 0

    # ----------------------------------------------------------- bookkeeping
    def record_sync(self, kind: str, op: str = "") -> None:
        """A host wait for the device: everything recorded before it has completed."""
        self.sync_log.append({"kind": kind, "site": call_site(), "op": op})
        self.last_sync = time.perf_counter()

    def fault(self, error: type, message: str) -> None:
        line = f"{message} at {call_site()}"
        self.violation_log.append(line)
        if self.raise_faults:
            raise error(line)

    def acquire(self, elem) -> list:
        storage = elem.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                entry = self._storages[key] = [nbytes, 0]
                self.allocated += nbytes
                self.allocated_total += nbytes
                self.peak = max(self.peak, self.allocated)
            entry[1] += 1
        return [key]

    def release(self, holder: list) -> None:
        key = holder[0]
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                self.allocated -= entry[0]
                del self._storages[key]

    # ----------------------------------------------------------- start
    def start(self) -> None:
        _define_tensor_type(self)
        _patch_tensor_constructors(self)
        _keep_parameter_attributes_on_moves(self)
        _patch_torch_cuda(self)
        _patch_distributed(self)
        _enter_mode_in_every_thread(self)


# --------------------------------------------------------------------- tensors
SimulatedCudaTensor = None  # the class, defined once torch is imported


def _define_tensor_type(sim: _Simulation) -> None:
    global SimulatedCudaTensor
    torch = sim.torch
    device = torch.device("cuda", 0)

    class SimulatedCudaTensor(torch.Tensor):  # noqa: F811
        """A CPU tensor (`elem`) that says it is on cuda:0."""

        @staticmethod
        def __new__(cls, elem):
            t = torch.Tensor._make_wrapper_subclass(
                cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
                layout=elem.layout, device=device, requires_grad=False)
            t.elem = elem
            t._holder = sim.acquire(elem)
            weakref.finalize(t, sim.release, t._holder)
            return t

        def __repr__(self):
            return f"SimulatedCudaTensor({self.elem!r})"

        @property
        def data(self):
            return torch.Tensor.data.__get__(self)

        @data.setter
        def data(self, new):
            torch.Tensor.data.__set__(self, new)
            if isinstance(new, SimulatedCudaTensor):
                sim.release(self._holder)
                self.elem = new.elem
                self._holder[0] = sim.acquire(new.elem)[0]
            else:
                self.elem = new

        def tolist(self):
            sim.record_sync("device-to-host copy", "tolist")
            return self.elem.tolist()

        def numpy(self, *, force=False):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return _dispatch(sim, func, args, kwargs or {})

    globals()["SimulatedCudaTensor"] = SimulatedCudaTensor
    sim.Tensor = SimulatedCudaTensor


# ops that take device and host tensors together on a real GPU
_MIXING_ALLOWED = {"aten::copy_", "aten::_to_copy", "aten::index.Tensor", "aten::index_put_", "aten::_index_put_impl_",
                   "aten::set_", "aten::_foreach_add_",
                   "aten::_foreach_add", "aten::_foreach_mul_", "aten::_foreach_div_", "aten::_foreach_lerp_",
                   "aten::_foreach_addcmul_", "aten::_foreach_addcdiv_", "aten::_foreach_sqrt",
                   "aten::_foreach_maximum_", "aten::_foreach_neg", "aten::_foreach_sub_",
                   "aten::_foreach_pow", "aten::_foreach_reciprocal_", "aten::_foreach_mul"}
# ops whose output shape depends on device values: the host waits for them
_DATA_DEPENDENT = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_consecutive",
                   "aten::unique_dim", "aten::bincount", "aten::nonzero_numpy", "aten::is_nonzero",
                   "aten::equal", "aten::allclose", "aten::_local_scalar_dense"}


def _op_name(func) -> str:
    return func._schema.name


def _dispatch(sim: _Simulation, func, args, kwargs):
    torch = sim.torch
    from torch.utils._pytree import tree_flatten, tree_map

    Sim = sim.Tensor
    name = _op_name(func)
    if name.startswith("c10d::"):
        return _collective(sim, func, name, args, kwargs)
    if name == "aten::_has_compatible_shallow_copy_type":
        # a plain CPU tensor cannot take a wrapped one's contents in place (`p.data = x.cuda()`
        # on a CPU parameter works on a GPU, not here): say so, rather than half do it
        if isinstance(args[0], Sim) != isinstance(args[1], Sim):
            return False
    flat, _ = tree_flatten((args, kwargs))
    on_device = [x for x in flat if isinstance(x, Sim)]
    host = [x for x in flat if isinstance(x, torch.Tensor) and not isinstance(x, Sim) and x.dim() > 0
            and x.device.type == "cpu"]

    target = _requested_device(kwargs)
    if name == "aten::copy_":
        _check_copy(sim, args, kwargs)
    elif name == "aten::_to_copy":
        _check_to_copy(sim, args[0], target, kwargs)
    elif on_device and host and name not in _MIXING_ALLOWED:
        sim.fault(DeviceMismatch, f"{name}: a host tensor {tuple(host[0].shape)} meets a cuda:0 tensor "
                                  "(expected all tensors on the same device)")
    if on_device and name in _DATA_DEPENDENT:
        sim.record_sync("value read" if name in ("aten::_local_scalar_dense", "aten::is_nonzero",
                                                 "aten::equal", "aten::allclose") else "data-dependent shape", name)
    elif on_device and name == "aten::index.Tensor" and any(
            isinstance(i, Sim) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])):
        sim.record_sync("data-dependent shape", "boolean index")

    inputs = {}

    def unwrap(x):
        if isinstance(x, Sim):
            inputs[id(x.elem)] = x
            return x.elem
        return x

    cpu = torch.device("cpu")
    args_c, kwargs_c = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    if target is not None and target.type == "cuda":
        kwargs_c["device"] = cpu
        kwargs_c.pop("pin_memory", None)
    seeded = (on_device or (target is not None and target.type == "cuda")) and _is_random(sim, func)
    if seeded:  # a device random op draws from the device's generator, as on a GPU
        out = _with_device_generator(sim, func, args_c, kwargs_c)
    else:
        out = func(*args_c, **kwargs_c)
    to_device = target.type == "cuda" if target is not None else bool(on_device)
    if not to_device:
        return out

    def wrap(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, Sim):
            same = inputs.get(id(x))
            return same if same is not None else Sim(x)
        return x

    return tree_map(wrap, out)


def _is_random(sim: _Simulation, func) -> bool:
    return sim.torch.Tag.nondeterministic_seeded in func.tags


def _with_device_generator(sim: _Simulation, func, args, kwargs):
    """Run a random op with the CPU's default generator in the device generator's state, then
    keep the state it leaves as the device generator's: CPU draws are untouched."""
    torch = sim.torch
    host_state = torch.get_rng_state()
    torch.set_rng_state(sim.generator.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        sim.generator.set_state(torch.get_rng_state())
        torch.set_rng_state(host_state)


def _requested_device(kwargs):
    import torch

    d = kwargs.get("device")
    if d is None:
        return None
    d = torch.device(d) if not isinstance(d, torch.device) else d
    return d


def _is_pinned(t) -> bool:
    try:
        return bool(t.is_pinned())
    except Exception:
        return False


def _check_copy(sim: _Simulation, args, kwargs) -> None:
    Sim = sim.Tensor
    dst, src = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if isinstance(dst, Sim) and not isinstance(src, Sim) and src.dim() > 0:
        if not (non_blocking and _is_pinned(src)):
            sim.record_sync("host-to-device copy" + (" from pageable memory" if not _is_pinned(src) else ", blocking"),
                            "aten::copy_")
    elif isinstance(src, Sim) and not isinstance(dst, Sim):
        if not (non_blocking and _is_pinned(dst)):
            sim.record_sync("device-to-host copy", "aten::copy_")


def _check_to_copy(sim: _Simulation, x, target, kwargs) -> None:
    Sim = sim.Tensor
    if target is None:
        return
    non_blocking = bool(kwargs.get("non_blocking", False))
    if isinstance(x, Sim) and target.type == "cpu":
        sim.record_sync("device-to-host copy", "aten::_to_copy")
    elif not isinstance(x, Sim) and target.type == "cuda" and x.dim() > 0:
        if not (non_blocking and _is_pinned(x)):
            sim.record_sync("host-to-device copy" + (" from pageable memory" if not _is_pinned(x) else ", blocking"),
                            "aten::_to_copy")


def _patch_tensor_constructors(sim: _Simulation) -> None:
    """`torch.tensor(data, device="cuda")` and its kin build the tensor with the dispatch
    modes switched off (straight on the device's backend, which a CPU build lacks): build
    it on the host, then copy it over as a GPU does (a blocking copy from pageable memory)."""
    import functools

    torch = sim.torch

    def host_values(data):
        """Device scalars inside `data` read on the host, one wait each (as torch does)."""
        if isinstance(data, sim.Tensor):
            return data.cpu() if data.dim() else data.item()
        if isinstance(data, (list, tuple)):
            return type(data)(host_values(x) for x in data)
        return data

    def on_host_then_copied(make, device_at=None):
        @functools.wraps(make)
        def made(*args, **kwargs):
            if args and isinstance(args[0], (list, tuple)):
                args = (host_values(args[0]),) + args[1:]
            device = kwargs.get("device")
            if device_at is not None and len(args) > device_at and device is None:
                device, args = args[device_at], args[:device_at] + args[device_at + 1:]
            target = torch.device(device) if device is not None and not isinstance(device, torch.device) else device
            if target is None or target.type != "cuda":
                return make(*args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")}
            host = make(*args, **kwargs)
            out = host.to(target)
            return out

        return made

    torch.tensor = on_host_then_copied(torch.tensor)
    torch.as_tensor = on_host_then_copied(torch.as_tensor)
    torch.asarray = on_host_then_copied(torch.asarray)
    new_tensor = torch.Tensor.new_tensor

    def new_tensor_on(self, data, *, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
        device = self.device if device is None else torch.device(device)
        if device.type != "cuda":
            return new_tensor(self, data, dtype=dtype, device=device, requires_grad=requires_grad)
        return torch.tensor(data, dtype=dtype or self.dtype).to(device).requires_grad_(requires_grad)

    torch.Tensor.new_tensor = new_tensor_on


def _keep_parameter_attributes_on_moves(sim: _Simulation) -> None:
    """`module.cuda()` moves a CPU parameter to a GPU in place (`param.data = ...`), keeping
    the attributes megatron-core sets on it (tensor_model_parallel, sequence_parallel, ...).
    A wrapped tensor cannot take a plain one's place, so torch makes a new Parameter and the
    attributes would be lost: copy them over, as the GPU keeps them."""
    torch = sim.torch
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameters, never set_data
    apply = torch.nn.Module._apply

    def apply_keeping_attributes(self, fn, recurse=True):
        before = {(id(m), name): p for m in self.modules() for name, p in m.named_parameters(recurse=False)}
        out = apply(self, fn, recurse)
        for m in self.modules():
            for name, p in m.named_parameters(recurse=False):
                old = before.get((id(m), name))
                if old is not None and old is not p:
                    for attr, value in vars(old).items():
                        if attr not in ("elem", "_holder"):
                            setattr(p, attr, value)
        return out

    torch.nn.Module._apply = apply_keeping_attributes


# --------------------------------------------------------------------- collectives
_P2P = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")


def _collective(sim: _Simulation, func, name, args, kwargs):
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    Sim = sim.Tensor
    flat, _ = tree_flatten((args, kwargs))
    group_name = next((name for name in map(_group_name, flat) if name is not None), "?")
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    host_group = group_name in sim.host_groups
    if not host_group:
        hosts = [t for t in tensors if not isinstance(t, Sim)]
        if hosts:
            sim.fault(HostCollective, f"{name} over group {group_name} (NCCL on a GPU) on a host tensor "
                                      f"{tuple(hosts[0].shape)} {hosts[0].dtype}")
        if name != "c10d::barrier" and name != "c10d::monitored_barrier_":
            peer = _peer(name, args) if name in _P2P else None
            sim.collective_log.append((group_name, name, peer, sim.batch))
    return func(*tree_map(lambda x: x.elem if isinstance(x, Sim) else x, args),
                **tree_map(lambda x: x.elem if isinstance(x, Sim) else x, kwargs))


def _group_name(x) -> str | None:
    """The name of a process group as c10d's ops carry it (a ScriptObject), else None."""
    import torch
    import torch.distributed as dist

    if isinstance(x, torch.ScriptObject) and "op" not in x._method_names():
        try:
            return dist.ProcessGroup.unbox(x).group_name
        except RuntimeError:
            return None
    return getattr(x, "group_name", None) if isinstance(x, dist.ProcessGroup) else None


def _peer(name, args):
    # c10d::send(tensors, group, dst, tag), c10d::recv_(tensors, group, src, tag)
    for a in args[2:]:
        if isinstance(a, int):
            return a
    return None


def order_cycle(per_rank: dict[int, list], group_ranks: dict[str, list[int]]) -> list | None:
    """NCCL's rule for ranks that share communicators: the collectives must be issuable in
    one global order. Each rank's k-th op on a group is one instance of that group's k-th
    collective; a rank's issue order adds edges between the instances; a cycle means some
    ranks wait on each other across communicators (with one hardware queue,
    CUDA_DEVICE_MAX_CONNECTIONS=1, a hang). Point-to-point ops pair the k-th send from a to
    b with the k-th receive on b from a; the ops of one `batch_isend_irecv` (a batch id)
    run as one. Returns a cycle (instance names) or None.
    `per_rank`: rank -> [(group, op, peer[, batch])], `group_ranks`: group -> its global ranks."""
    parent: dict = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order: dict[int, list] = {}
    for rank, ops in per_rank.items():
        counts: dict = {}
        seq = []
        for entry in ops:
            group, op, peer = entry[:3]
            batch = entry[3] if len(entry) > 3 else None
            if op in _P2P and peer is not None:
                members = group_ranks.get(group)
                other = members[peer] if members else peer
                channel = (group, rank, other) if op == "c10d::send" else (group, other, rank)
            else:
                channel = (group,)
            k = counts.get(channel, 0)
            counts[channel] = k + 1
            node = channel + (k,)
            find(node)
            if batch is not None and seq and seq[-1][1] == batch:
                parent[find(node)] = find(seq[-1][0])  # one launch: one node
            seq.append((node, batch))
        order[rank] = [node for node, _ in seq]
    edges: dict = {}
    for nodes in order.values():
        roots = [find(n) for n in nodes]
        for a, b in zip(roots, roots[1:]):
            edges.setdefault(a, set())
            if a != b:
                edges[a].add(b)
            edges.setdefault(b, set())
    state_of: dict = {}
    stack: list = []

    def visit(node) -> list | None:
        state_of[node] = 1
        stack.append(node)
        for nxt in edges.get(node, ()):
            if state_of.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if state_of.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state_of[node] = 2
        return None

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in list(edges):
        if state_of.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


# --------------------------------------------------------------------- torch.cuda
class _Properties:
    def __init__(self, memory_bytes: int):
        self.name = "NVIDIA H200"
        self.total_memory = memory_bytes
        self.major, self.minor = 9, 0
        self.multi_processor_count = 132
        self.gcnArchName = ""
        self.uuid = "simulated"
        self.L2_cache_size = 60 * 2**20
        self.is_integrated = False
        self.warp_size = 32


def _patch_torch_cuda(sim: _Simulation) -> None:
    import torch

    cuda = torch.cuda
    cuda._lazy_init = lambda: None
    cuda._lazy_call = lambda callable, **kwargs: callable()
    cuda.is_initialized = lambda: True
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.get_device_name = lambda device=None: "NVIDIA H200"
    cuda.get_device_properties = lambda device=None: _Properties(sim.memory_bytes)
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.is_bf16_supported = lambda including_emulation=True: True
    cuda.default_generators = (sim.generator,)
    cuda.random.default_generators = cuda.default_generators

    def synchronize(device=None):
        sim.record_sync("torch.cuda.synchronize")

    cuda.synchronize = synchronize
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: sim.allocated
    cuda.max_memory_allocated = lambda device=None: sim.peak
    cuda.memory_reserved = lambda device=None: sim.allocated
    cuda.max_memory_reserved = lambda device=None: sim.peak

    def reset_peak(device=None):
        sim.peak = sim.allocated

    cuda.reset_peak_memory_stats = reset_peak
    cuda.reset_max_memory_allocated = reset_peak
    cuda.mem_get_info = lambda device=None: (sim.memory_bytes - sim.allocated, sim.memory_bytes)
    cuda.memory_stats = lambda device=None: {"allocated_bytes.all.current": sim.allocated,
                                             "allocated_bytes.all.peak": sim.peak}
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.set_sync_debug_mode = lambda mode: None

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
            self.time = None
            self.complete = False

        def record(self, stream=None):
            self.time = time.perf_counter()
            self.complete = False

        def wait(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            sim.record_sync("event synchronize")
            self.complete = True

        def elapsed_time(self, end):
            for e in (self, end):
                if e.time is None:
                    raise EventNotReady("elapsed_time on an event that was never recorded")
                if not e.complete and sim.last_sync < e.time:
                    raise EventNotReady("CUDA error: device not ready (elapsed_time before the events completed)")
            return (end.time - self.time) * 1000.0

    class Stream:
        def __init__(self, device=None, priority=0, **kwargs):
            self.device = torch.device("cuda", 0)

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            event = event or Event()
            event.record(self)
            return event

        def query(self):
            return True

        def synchronize(self):
            sim.record_sync("stream synchronize")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cuda.Event, cuda.Stream = Event, Stream
    cuda.streams.Event, cuda.streams.Stream = Event, Stream
    default_stream = Stream()
    cuda.current_stream = lambda device=None: default_stream
    cuda.default_stream = lambda device=None: default_stream
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    _rebind_imported_names(cuda)


def _rebind_imported_names(cuda) -> None:
    """torch.cuda's submodules import some of these functions by name (`from . import
    current_device`): point every such name at the stand-in too."""
    import types

    originals = {}
    for name in ("_lazy_init", "_lazy_call", "is_initialized", "is_available", "device_count", "current_device",
                 "synchronize", "current_stream", "default_stream", "get_device_properties", "Event", "Stream"):
        originals[name] = getattr(cuda, name)
    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name.startswith("torch.cuda") or mod_name.startswith("torch.random")) or \
                not isinstance(mod, types.ModuleType) or mod is cuda:
            continue
        for name, stand_in in originals.items():
            if name in vars(mod) and getattr(mod, name) is not stand_in:
                setattr(mod, name, stand_in)


# --------------------------------------------------------------------- torch.distributed
def _patch_distributed(sim: _Simulation) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        asked = backend or kwargs.pop("backend", None)
        group_backend = "gloo"
        result = init(group_backend, *args, **kwargs)
        world = dist.group.WORLD
        sim.group_ranks[world.group_name] = list(range(dist.get_world_size()))
        if asked is not None and str(asked).startswith("gloo"):
            sim.host_groups.add(world.group_name)
        return result

    dist.init_process_group = init_process_group
    c10d.init_process_group = init_process_group

    batch_isend_irecv = dist.batch_isend_irecv

    def batched(p2p_op_list):  # one NCCL group launch: the order check treats it as one op
        sim.batches += 1
        sim.batch = sim.batches
        try:
            return batch_isend_irecv(p2p_op_list)
        finally:
            sim.batch = None

    dist.batch_isend_irecv = batched
    c10d.batch_isend_irecv = batched

    new_group = dist.new_group

    def new_group_noting_backend(*args, **kwargs):
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and str(backend).lower() == "nccl":
            kwargs["backend"] = "gloo"
            if len(args) > 2:
                args = args[:2] + ("gloo",) + args[3:]
        group = new_group(*args, **kwargs)
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            sim.group_ranks[group.group_name] = dist.get_process_group_ranks(group)
        if backend is not None and str(backend).lower().startswith("gloo") and group is not None and \
                group != dist.GroupMember.NON_GROUP_MEMBER:
            sim.host_groups.add(group.group_name)
        return group

    dist.new_group = new_group_noting_backend
    c10d.new_group = new_group_noting_backend

    object_device = c10d._get_object_coll_device

    def object_collective_device(group=None):
        pg = group or c10d._get_default_group()
        return "cpu" if pg.group_name in sim.host_groups else "cuda"

    c10d._get_object_coll_device = object_collective_device
    dist.is_nccl_available = lambda: True
    sim._object_device = object_device


# --------------------------------------------------------------------- the mode
def _enter_mode_in_every_thread(sim: _Simulation) -> None:
    """Factories asked for device="cuda" and host-to-device copies have no device tensor to
    dispatch on: a dispatch mode catches them, in this thread and in every thread started
    later (Python's threads start with no mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _push_mode

    class SimulatedCudaMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return _dispatch(sim, func, args, kwargs or {})

    sim.mode_class = SimulatedCudaMode
    _push_mode(SimulatedCudaMode())
    run = threading.Thread.run

    def run_in_mode(self):
        try:
            _push_mode(SimulatedCudaMode())
        except Exception:
            traceback.print_exc()
        return run(self)

    threading.Thread.run = run_in_mode
