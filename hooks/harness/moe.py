"""The harness's mixture-of-experts feed-forward: top-k routing, all-to-all token dispatch over
the ``ep`` group, SwiGLU experts, and the tokens each local expert received (its load).

Each of the ``ep`` ranks holds ``experts // ep`` consecutive experts.  A forward sorts its
tokens by expert, swaps the per-expert counts in one ``all_to_all_single``, sends the tokens to
their experts' ranks in another (uneven splits, with autograd), runs the local experts and sends
the outputs back the same way.  Without an ep group every expert is local and nothing is sent.
:attr:`MoE.load` adds up the tokens per local expert until the harness reads it
(:func:`take_expert_load`), once a step, for ``Monitor.expert_load``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Experts", "MoE", "take_expert_load"]


class MoE(nn.Module):
    """``experts`` SwiGLU experts of width ``hidden_dim``; each token goes to its ``top_k`` best.

    ``router_bias``: ``{expert: logit}`` added to the router's scores (a hot expert, for tests).
    """

    def __init__(self, dim: int, hidden_dim: int, experts: int, top_k: int = 1, ep: int = 1, ep_rank: int = 0,
                 router_bias: dict[int, float] | None = None) -> None:
        super().__init__()
        if experts < 1 or experts % ep:
            raise ValueError(f"--experts {experts} must be a positive multiple of --ep {ep}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"--top-k {top_k} must be between 1 and --experts {experts}")
        self.n_experts, self.top_k, self.ep, self.ep_rank = experts, top_k, ep, ep_rank
        self.local = experts // ep
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(self.local, dim, hidden_dim)
        self.router_bias = {e: float(b) for e, b in (router_bias or {}).items() if 0 <= e < experts}
        self.group: Any = None
        """The ``ep`` process group (set when the model is parallelised); None: no dispatch."""
        self.load = torch.zeros(self.local, dtype=torch.long, device="cpu")
        """Tokens each local expert received since it was last taken."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores = self.router(flat)
        if self.router_bias:
            bias = torch.zeros(self.n_experts, device=scores.device, dtype=scores.dtype)
            bias[list(self.router_bias)] = torch.tensor(list(self.router_bias.values()), dtype=scores.dtype)
            scores = scores + bias
        probs = scores.softmax(-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        choice = expert.reshape(-1)
        order = torch.argsort(choice, stable=True)
        source = order // self.top_k           # the token each sorted slot carries
        counts = torch.bincount(choice, minlength=self.n_experts)
        tokens = flat[source]
        if self.group is not None:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            per_source = received.view(self.ep, self.local)
            send = counts.view(self.ep, self.local).sum(1).tolist()
            recv = per_source.sum(1).tolist()
            tokens = _all_to_all(tokens, recv, send, self.group)
        else:
            per_source = counts.view(1, self.local)
            send = recv = None
        out = self.experts(tokens, per_source.tolist())
        if self.group is not None:
            out = _all_to_all(out, send, recv, self.group)
        self.load += per_source.sum(0).to(self.load.dtype).cpu()
        y = torch.zeros_like(flat).index_add(0, source, out * weight.reshape(-1)[order, None])
        return y.reshape(shape)



class Experts(nn.Module):
    """This rank's ``local`` SwiGLU experts, their weights stacked (FSDP2 shards them apart
    from the dense weights: each ep rank holds its own)."""

    def __init__(self, local: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(local, dim, hidden_dim) * dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(local, dim, hidden_dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(local, hidden_dim, dim) * hidden_dim ** -0.5)

    def forward(self, tokens: torch.Tensor, per_source: list[list[int]]) -> torch.Tensor:
        """Each received slice through its expert; ``per_source[s][e]`` tokens from rank s for expert e."""
        outs, at = [], 0
        for row in per_source:
            for e, n in enumerate(row):
                if n:
                    z = tokens[at:at + n]
                    outs.append((F.silu(z @ self.w1[e]) * (z @ self.w3[e])) @ self.w2[e])
                    at += n
        # An expert that got no tokens still joins the graph (its gradient is zero, not missing).
        idle = sum(w.sum() for w in (self.w1, self.w2, self.w3)) * 0.0
        return torch.cat(outs) + idle if outs else tokens[:0] * 0 + idle


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """``x``'s rows sent ``in_splits`` to each rank, ``out_splits`` from each received (autograd)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(out_splits), x.shape[-1]))
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


def take_expert_load(model: nn.Module) -> list[int]:
    """Tokens each local expert received since the last call, summed over the model's MoE layers
    (expert i of every layer counts as local expert i); [] for a model without experts."""
    total: torch.Tensor | None = None
    for module in model.modules():
        if isinstance(module, MoE):
            total = module.load.clone() if total is None else total + module.load
            module.load.zero_()
    return [] if total is None else [int(n) for n in total.tolist()]
