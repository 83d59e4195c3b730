"""Run one replica's micro-batches: packed THD documents, CP chunks, 1F1B over its stages.

Every shape is known from the plan (token counts per micro-batch), so stages exchange
activations with plain point-to-point ops and no shape handshakes. The loss of every
micro-batch is its token-loss sum times `loss_scale` (1 / the global batch's loss-token
count), so gradients do not depend on how documents were split (docs/contracts.md, "Loss").
Recompute is chosen per micro-batch by setting the stage config's full-recompute layer
count for its forward only (megatron-core reads it at forward time; restored after).
The engine's pull and push streams ride along: every pull must be complete before a
stage blocks on a peer (its first receive) or sends its first activation, since all
ranks take part in every bucket; the push starts tracking final gradients when the last
micro-batch's backward begins, on a pipeline's first stage (and every single-stage replica)
only: a later stage still sends that backward's gradient to the stage before it, and a push
issued before that send would put the world's transfers and the pipeline's on its two ranks
in opposite orders (NCCL can hang on that), so later stages push once they are done.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_ext.runtime.host_device import place_packed_seq_params, to_device
from dcp_ext.runtime.step_result import ForwardStepError
from dcp_ext.runtime.schedule.context_parallel import cp_token_indices


@dataclass
class LocalMicroBatch:
    tokens: torch.Tensor  # [1, t_local]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: object
    hidden_shape: tuple[int, int, int]  # activations between stages: [s, 1, h]
    recompute_layers: int
    loss_tokens: float = 0.0  # this rank's loss-mask sum, counted on the host
    strategies: tuple | None = None  # (tp, cp) of each layer of the stage when the plan switches them
    relayout: object = None  # layer_switch.StageRelayout, built on first use

    def fields(self) -> "MicroBatchFields":
        """What the entry point's forward_step reads: the static path's batch keys."""
        return MicroBatchFields(tokens=self.tokens, labels=self.labels, loss_mask=self.loss_mask,
                                position_ids=self.position_ids, packed_seq_params=self.packed_seq_params)


class MicroBatchFields(dict):
    """A micro-batch as the entry point's forward_step gets it; a key it lacks is one line."""

    def __missing__(self, key):
        raise ForwardStepError(f"the entry point's forward_step reads batch[{key!r}], which --dcp micro-batches do "
                               f"not carry (they carry {', '.join(self)}): read only those, or train without --dcp")


def localize(batch, cp: int, cp_rank: int, tp: int, sequence_parallel: bool, hidden: int,
             recompute_layers: int, device=None, lengths_on_host: bool = True) -> LocalMicroBatch:
    """This CP rank's load-balanced share of a packed micro-batch (global cu_seqlens kept),
    on `device` without a host wait; the cu_seqlens stay on the host when the layers read
    them there (`lengths_on_host`, dcp_ext.runtime.host_device)."""
    padded = torch.diff(batch.cu_seqlens_padded).tolist()
    idx = cp_token_indices(padded, cp, cp_rank)
    t_local = idx.numel()
    seq = t_local // tp if sequence_parallel else t_local
    psp = batch.packed_seq_params()
    mask = batch.loss_mask[idx]
    if device is None:
        take = lambda x: x[idx].unsqueeze(0)  # noqa: E731
    else:
        take = lambda x: to_device(x[idx].unsqueeze(0), device)  # noqa: E731
        psp = place_packed_seq_params(psp, device, lengths_on_host)
    return LocalMicroBatch(take(batch.tokens), take(batch.labels), take(batch.loss_mask), take(batch.position_ids),
                           psp, (seq, 1, hidden), recompute_layers, loss_tokens=float(mask.sum()))


RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def set_recompute(config, layers_in_stage: int, layers: int) -> None:
    if layers <= 0:
        config.recompute_granularity = None
        config.recompute_method = None
        config.recompute_num_layers = None
    else:
        config.recompute_granularity = "full"
        config.recompute_method = "block"
        config.recompute_num_layers = min(layers, layers_in_stage)


@contextmanager
def recompute_during(config, layers_in_stage: int, layers: int):
    """Full recompute of `layers` of the stage for one forward. megatron-core reads the
    recompute fields from the stage's TransformerConfig when a forward decides what to
    checkpoint, so they are set for that forward only and restored after it: the config
    the stage was built with is never left changed."""
    saved = tuple(getattr(config, f) for f in RECOMPUTE_FIELDS)
    set_recompute(config, layers_in_stage, layers)
    try:
        yield
    finally:
        for f, v in zip(RECOMPUTE_FIELDS, saved):
            setattr(config, f, v)


class StageRunner:
    """One rank's stage of one replica."""

    def __init__(self, model, config, rep, rank: int, num_layers: int, switching=None, forward_step=None):
        """switching: the stage's layer_switch.SwitchContext when its micro-batches may
        switch layer strategies. forward_step: the entry point's `forward_step(data_iterator,
        model) -> (output, loss_func)`, as the static path calls it; None: the model's
        per-token loss summed under the loss mask."""
        self.model = model
        self.forward_step = forward_step
        self.config = config
        self.rep = rep
        self.tp_rank, self.cp_rank, self.pp_rank = rep.coords(rank)
        self.first = self.pp_rank == 0
        self.last = self.pp_rank == rep.pp - 1
        first, end = rep.stage_range(self.pp_rank, num_layers)
        self.layers_in_stage = end - first
        self.switching = switching
        self.prev = None if self.first else rep.rank_at(self.tp_rank, self.cp_rank, self.pp_rank - 1)
        self.next = None if self.last else rep.rank_at(self.tp_rank, self.cp_rank, self.pp_rank + 1)
        self.dtype = config.pipeline_dtype or torch.float32

    def _forward(self, mb: LocalMicroBatch, x):
        # the plan's recompute count is for the whole model: this stage's share
        share = -(-mb.recompute_layers * self.layers_in_stage // max(self.config.num_layers, 1))
        if not self.first:
            self.model.set_input_tensor(x)
        if mb.strategies is not None:
            switch = self.switching.for_micro_batch(mb, share)
            with recompute_during(self.config, self.layers_in_stage, 0), switch.installed(self.model.decoder):
                return self._call(mb)
        with recompute_during(self.config, self.layers_in_stage, share):
            return self._call(mb)

    def _call(self, mb: LocalMicroBatch):
        """(the stage's output, the loss function of the entry point's forward_step or None)."""
        if self.forward_step is None:
            return self.model(mb.tokens, mb.position_ids, None, labels=mb.labels if self.last else None,
                              packed_seq_params=mb.packed_seq_params), None
        return self.forward_step(iter([mb.fields()]), self.model)

    @staticmethod
    def _loss(mb: LocalMicroBatch, out, loss_func):
        """A last stage's micro-batch: (the loss to back-propagate, before the global batch's
        scale; its reported sum; its reported token count), the entry point's loss function
        deciding all three when there is one (as on the static path: its 'lm loss' report)."""
        if loss_func is None:
            loss = (out.float() * mb.loss_mask.float()).sum()
            return loss, loss.detach().double(), mb.loss_tokens
        result = loss_func(out)
        if not isinstance(result, (tuple, list)) or len(result) != 3:
            raise ForwardStepError("under --dcp the entry point's loss function must return (loss summed over the "
                                   "micro-batch's tokens, their count, a report dict), upstream's per-token form")
        loss, count, report = result
        reported = report.get("lm loss") if isinstance(report, dict) else None
        if reported is None:
            return loss, loss.detach().double(), count.detach().double()
        reported = reported.detach().double().reshape(-1)
        return loss, reported[0], reported[1]

    def evaluate(self, micro_batches: list[LocalMicroBatch], pull=None) -> tuple[torch.Tensor, float]:
        """Forward only, stage by stage. Returns (loss sum on the device, loss tokens) on the
        last stage, (0, 0) elsewhere."""
        self.model.eval()
        pull = pull or _NoStream()
        loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=_device(self.model)), 0.0
        with torch.no_grad():
            for i, mb in enumerate(micro_batches):
                if not self.first:
                    pull.drain()
                x = self._recv_forward(i, micro_batches)
                out, loss_func = self._forward(mb, x)
                pull.drain()
                if self.last:
                    _, reported, count = self._loss(mb, out, loss_func)
                    loss_sum += reported
                    tokens = tokens + count
                else:
                    self._send(out, self.next)
        self.model.train()
        return loss_sum, tokens

    def run(self, micro_batches: list[LocalMicroBatch], loss_scale: float, pull=None, push=None,
            clock=None) -> tuple[torch.Tensor, float]:
        """Forward and backward every micro-batch (1F1B). Returns (loss sum on the device, loss
        tokens) on the last stage, (0, 0) elsewhere: nothing here waits for the device.
        `clock` (device_clock.DeviceClock) times each micro-batch's forward and backward
        compute, not the waits for peers."""
        self.model.train()
        pull, push = pull or _NoStream(), push or _NoStream()
        clock = clock or _NoClock()
        if not self.first:
            pull.drain()
        n = len(micro_batches)
        warmup = min(self.rep.pp - self.pp_rank - 1, n)
        pending = deque()  # (input activation, output) awaiting backward
        loss_sum = torch.zeros((), dtype=torch.float64, device=_device(self.model))
        tokens = 0.0

        def forward(i, x):
            nonlocal loss_sum, tokens
            mb = micro_batches[i]
            with clock.timing(i):
                out, loss_func = self._forward(mb, x)
                pull.drain()
                if self.last:
                    loss, reported, count = self._loss(mb, out, loss_func)
                    loss_sum = loss_sum + reported
                    tokens = tokens + count
                    out = loss * loss_scale
            pending.append((x, out))
            return out

        backwards = [0]

        def backward(grad):
            backwards[0] += 1
            if backwards[0] == n and self.first:  # later stages: after their last send (see above)
                push.last_backward()
            x, out = pending.popleft()
            with clock.timing(backwards[0] - 1):
                if self.last:
                    out.backward()
                else:
                    torch.autograd.backward(out, grad_tensors=grad)
            return None if x is None else x.grad

        for i in range(warmup):
            x = self._recv_forward(i, micro_batches)
            out = forward(i, x)
            self._send(out, self.next)
        remaining = n - warmup
        x = self._recv_forward(warmup, micro_batches) if remaining > 0 else None
        for k in range(remaining):
            i = warmup + k
            out = forward(i, x)
            j = i - warmup  # micro-batch whose backward follows
            grad = self._exchange(send=out if not self.last else None, send_to=self.next,
                                  recv_shape=None if self.last else micro_batches[j].hidden_shape,
                                  recv_from=self.next)
            x_grad = backward(grad)
            last_iter = k == remaining - 1
            x = self._exchange(send=x_grad, send_to=self.prev,
                               recv_shape=None if (self.first or last_iter) else micro_batches[i + 1].hidden_shape,
                               recv_from=self.prev)
        for j in range(n - warmup, n):
            grad = self._exchange(send=None, send_to=None, recv_shape=None if self.last else micro_batches[j].hidden_shape,
                                  recv_from=self.next)
            x_grad = backward(grad)
            self._send(x_grad, self.prev)
        return loss_sum, tokens

    # ------------------------------------------------------------- p2p helpers
    def _recv_forward(self, i, micro_batches):
        if self.first:
            return None
        x = torch.empty(micro_batches[i].hidden_shape, dtype=self.dtype, device=_device(self.model))
        dist.recv(x, src=self.prev)
        return x.requires_grad_() if torch.is_grad_enabled() else x

    def _send(self, tensor, peer):
        if peer is None or tensor is None:
            return
        dist.send(tensor.detach().contiguous(), dst=peer)

    def _exchange(self, send, send_to, recv_shape, recv_from):
        """Send and receive in one batch (1F1B's paired ops), so neither side blocks first."""
        ops = []
        received = None
        if send is not None and send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), send_to))
        if recv_shape is not None and recv_from is not None:
            received = torch.empty(recv_shape, dtype=self.dtype, device=_device(self.model))
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if received is not None and recv_from == self.prev:
            received.requires_grad_()
        return received


class _NoClock:
    @contextmanager
    def timing(self, index):
        yield


class _NoStream:
    def drain(self):
        pass

    def last_backward(self):
        pass


def _device(model):
    return next(model.parameters()).device
