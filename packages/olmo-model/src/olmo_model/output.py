"""What either trainer's model returns: ``forward(input_ids, doc_ids=None, labels=None)`` ->
``ModelOutput``. One type for both frameworks (a NamedTuple: a JAX pytree, and an output
``torch.compile`` traces), so a caller never guesses which of several shapes came back."""

from __future__ import annotations

from typing import Any, NamedTuple


class ModelOutput(NamedTuple):
    """``logits``: [B, S, padded_vocab], when no ``labels`` were given (else None).

    ``loss_sums``: with ``labels`` [B, S], the float32 [3] sums ``[ce + z_loss_weight * z, ce,
    z]`` over the labels != ``IGNORE_INDEX`` (the output head and the loss run fused, chunk by
    chunk: the full logits never exist); None without labels. Divide by the label count for the
    means; only the first entry carries the gradient the trainers use.

    ``moe``: the MoE layers' routing statistics in the framework's own type (torch: a list of
    ``RoutingSums``, one per MoE layer; JAX: one ``RoutingStats`` over the stacked layers); None
    for a dense spec."""

    logits: Any = None
    loss_sums: Any = None
    moe: Any = None
