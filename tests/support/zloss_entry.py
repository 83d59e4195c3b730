"""pretrain_gpt_dcp.py with a z-loss in the user's forward_step: the model returns logits, the
loss function computes the cross entropy itself and adds ZLOSS_COEFF * logsumexp(logits)^2 per
token (PaLM's z-loss); each call appends its sums (cross entropy, z term, tokens) as a JSON
line to ZLOSS_LOG.<rank>.

Why it exists: users change exactly this; tests/training/test_forward_step.py checks that both paths
train and log the user's loss: (sum of cross entropy + coeff * sum of z) / tokens over the
global batch, from the sums this entry recorded."""
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt_dcp  # noqa: E402

COEFF = float(os.environ.get("ZLOSS_COEFF", "0.0"))


def z_loss(labels, loss_mask, logits):
    logits = logits.float()
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    ce = torch.nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="none")
    z = torch.logsumexp(flat, dim=-1) ** 2
    mask = loss_mask.float().reshape(-1)
    ce_sum, z_sum, count = torch.sum(ce * mask), torch.sum(z * mask), mask.sum()
    log = os.environ.get("ZLOSS_LOG")
    if log:
        with open(f"{log}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps({"ce": ce_sum.item(), "z": z_sum.item(), "tokens": count.item()}) + "\n")
    loss = ce_sum + COEFF * z_sum
    report = torch.stack([loss.detach(), count.detach()])
    return loss, count.to(torch.int), {"lm loss": report}


def forward_step(data_iterator, model):
    from megatron.training.loop.batches import get_batch

    batch = get_batch(data_iterator, model)
    logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
    return logits, partial(z_loss, batch["labels"], batch["loss_mask"])


if __name__ == "__main__":
    pretrain_gpt_dcp.quiet_known_warnings()
    from dcp_ext.compat import cpu_compat
    from megatron.training.training import pretrain

    cpu_compat.install()
    pretrain(pretrain_gpt_dcp.train_valid_test_datasets_provider, pretrain_gpt_dcp.model_provider, forward_step,
             argv=sys.argv[1:], document_datasets_provider=pretrain_gpt_dcp.document_datasets_provider)
