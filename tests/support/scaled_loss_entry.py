"""pretrain_gpt_dcp.py with a user's own forward_step: the loss (and its report) scaled by
SCALED_LOSS_FACTOR, or, with SCALED_LOSS_READS set, a batch key the --dcp runtime lacks read.

Why it exists: users customise exactly this function (upstream's z-loss and auxiliary terms
live there); tests/training/test_forward_step.py runs it on both paths
and checks the runtime trained on the user's loss."""
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain_gpt_dcp  # noqa: E402

FACTOR = float(os.environ.get("SCALED_LOSS_FACTOR", "1.5"))


def scaled_loss(loss_mask, output_tensor):
    loss, count, report = pretrain_gpt_dcp.loss_func(loss_mask, output_tensor)
    return loss * FACTOR, count, {"lm loss": report["lm loss"] * report["lm loss"].new_tensor([FACTOR, 1.0])}


def forward_step(data_iterator, model):
    try:
        from megatron.training.loop.batches import get_batch
    except ImportError:  # an entry point written before get_batch existed
        batch = next(data_iterator)
    else:
        batch = get_batch(data_iterator, model)
    if os.environ.get("SCALED_LOSS_READS"):
        batch[os.environ["SCALED_LOSS_READS"]]
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch["packed_seq_params"])
    return output, partial(scaled_loss, batch["loss_mask"])


if __name__ == "__main__":
    pretrain_gpt_dcp.quiet_known_warnings()
    from dcp_ext.compat import cpu_compat
    from megatron.training.training import pretrain

    cpu_compat.install()
    pretrain(pretrain_gpt_dcp.train_valid_test_datasets_provider, pretrain_gpt_dcp.model_provider, forward_step,
             argv=sys.argv[1:], document_datasets_provider=pretrain_gpt_dcp.document_datasets_provider)
