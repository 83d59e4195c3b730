"""pretrain_gpt_dcp.py with the logits of every forward of every rank written down.

Why it exists: tests/checkpoint/test_checkpoint_hf.py (and test_checkpoint_hf_families.py, per family)
holds the logits of an imported model, on the static path and under --dcp, to the Hugging
Face forward on the same tokens. The runs are
the real entry point, unchanged; this wrapper only registers hooks on every GPTModel built:
a pre-hook keeps the forward's tokens, labels, position ids and packed-sequence offsets, and
a hook on the output layer writes its logits (this rank's vocabulary shard) with the output
layer's TP rank and size to `$HF_LOGITS_DUMP.RANK.K.pt` (the rank's K-th forward). Keep the
runs short (one iteration): every forward is written.
"""
import os
import runpy
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DUMP = os.environ["HF_LOGITS_DUMP"]
_seen = {"inputs": None, "count": 0}


def _keep_inputs(module, args, kwargs):
    tokens = kwargs.get("input_ids", args[0] if args else None)
    positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    labels = kwargs.get("labels")
    packed = kwargs.get("packed_seq_params")
    offsets = lengths = None
    if packed is not None:
        padded = getattr(packed, "cu_seqlens_q_padded", None)
        offsets = (padded if padded is not None else packed.cu_seqlens_q).cpu()
        lengths = (packed.cu_seqlens_q[1:] - packed.cu_seqlens_q[:-1]).cpu()
    _seen["inputs"] = {"tokens": None if tokens is None else tokens.detach().cpu(),
                       "positions": None if positions is None else positions.detach().cpu(),
                       "labels": None if labels is None else labels.detach().cpu(),
                       "offsets": offsets, "lengths": lengths}


def _dump_logits(layer, args, output):
    if _seen["inputs"] is None or _seen["inputs"]["tokens"] is None:
        return
    logits = output[0] if isinstance(output, tuple) else output
    group = getattr(layer, "tp_group", None)
    tp_rank, tp_size = (group.rank(), group.size()) if group is not None else (0, 1)
    torch.save(dict(_seen["inputs"], logits=logits.detach().float().cpu(), tp_rank=tp_rank, tp_size=tp_size),
               f"{DUMP}.{os.environ.get('RANK', '0')}.{_seen['count']}.pt")
    _seen["count"] += 1
    _seen["inputs"] = None


def _install() -> None:
    from megatron.core.models.gpt import GPTModel

    init = GPTModel.__init__

    def hooked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_forward_pre_hook(_keep_inputs, with_kwargs=True)
        if getattr(self, "post_process", False) and getattr(self, "output_layer", None) is not None:
            self.output_layer.register_forward_hook(_dump_logits)

    GPTModel.__init__ = hooked


sys.path.insert(0, REPO)
_install()
sys.argv[0] = os.path.join(REPO, "pretrain_gpt_dcp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
