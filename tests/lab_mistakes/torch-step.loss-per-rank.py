"""A planted mistake in the torch peer's loss (tests/peers/torch_peer.py, micro_batch_loss): each rank
averages over its own selected positions, as Hugging Face's BertForMaskedLM does, instead of over the whole
global batch's. make check-peer PEER=torch checks that tests/check_trace.py names it with the words of the
"expect" line."""
# expect: the mean of the ranks' own means
import torch.nn.functional as F


def micro_batch_loss(logits, labels, selected_in_global_batch, world_size):
    # the mistake: the mean over this micro-batch's own selected positions; DDP then averages the ranks' means
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
