"""The policy's next-token entropies of replay-buffer items, through OpenRLHF's own actor forward.

``Actor.forward(return_entropy=True)`` gives the loss's entropy (temperature-scaled logits): the entropy control of
the in-step fidelity metric and of ``mode=auto`` (docs/fidelity.md §1). OpenRLHF's experiences carry no entropies, so the rows a step
measures (``fidelity_rows`` per rank) are run once more, on calibration and fidelity steps only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from oar_verl.core.backends.collectives import max_over_ranks
from oar_verl.openrlhf.reshape import item_rows

__all__ = ["policy_entropies"]


def policy_entropies(actor, items: Sequence, device: torch.device | str) -> Callable[[list[int]], list[torch.Tensor]]:
    """A function of item indices -> each item's (R,) float64 entropies over its response tokens (on the CPU).

    Every rank calls the function together (ZeRO-3 gathers parameters inside every forward): it runs one forward per
    row, as many as the rank with the most rows, a rank's first item standing in for the rows it lacks (results
    discarded).

    Args:
        actor: OpenRLHF's ``Actor`` wrapper of the policy (``PolicyModelActor.actor``).
        items: the replay buffer's per-sample items (``sequences``, ``attention_mask``, ``action_mask``).
        device: where the actor runs.
    """
    rows = item_rows(items)

    def entropies(idx: list[int]) -> list[torch.Tensor]:
        n = max_over_ranks(len(idx), torch.device(device))
        out = []
        was_training = actor.training
        actor.eval()
        try:
            for k in range(n):  # per row, one forward each: rows of different lengths, aligned over the ranks
                i = idx[k] if k < len(idx) else 0
                seq = items[i].sequences.reshape(1, -1).to(device)
                mask = (items[i].attention_mask.reshape(1, -1) if items[i].attention_mask is not None
                        else torch.ones_like(seq)).to(device)
                with torch.no_grad():
                    output = actor(seq, None, mask, return_output=True, return_entropy=True)
                if k < len(idx):
                    # output.entropy[:, j]: the entropy of the prediction of token j + 1; the response starts at
                    # starts[i] + 1 (item_rows)
                    start, length = rows.starts[i], len(rows.responses[i])
                    out.append(output.entropy[0, start: start + length].double().cpu())
        finally:
            actor.train(was_training)
        return out

    return entropies
