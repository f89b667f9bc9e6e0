"""A small Llama-style decoder: embedding, RMSNorm, attention, SwiGLU MLP (or a mixture of experts).

Attention computes its head count from the projection's output width, so the
same code runs whole or with its projections split across a TP group; with a
context-parallel group it attends its sequence chunk's queries to every chunk's
keys (:class:`Attention`).  A pipeline stage is the same model with the parts of
other stages removed (``tok_embeddings``/``norm``/``output`` None, fewer
``layers``): the blocks are keyed by their index in the whole model, so a
stage's parameter names are the whole model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "Transformer"]


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int = 512
    """Tokens in the vocabulary."""
    dim: int = 64
    """Model width."""
    n_layers: int = 2
    """Decoder blocks."""
    n_heads: int = 4
    """Attention heads; must be divisible by the TP degree."""
    hidden_dim: int = 128
    """MLP width; must be divisible by the TP degree."""
    seq_len: int = 32
    """Tokens per sample."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        for knob in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "seq_len"):
            if getattr(self, knob) <= 0:
                raise ValueError(f"ModelConfig.{knob} must be positive")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cp_group: Any = None
        """Context parallelism: the group whose ranks hold consecutive chunks of the
        sequence (this rank's is chunk ``cp_rank``); None: the whole sequence is here."""
        self.cp_rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local head count under TP.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.cp_group is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # every chunk's keys and values (all-gathered, with autograd), a causal mask at this chunk's offset
            k, v = (_gather_sequence(z, self.cp_group) for z in (k, v))
            pos = torch.arange(self.cp_rank * t, (self.cp_rank + 1) * t, device=x.device)
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _gather_sequence(z: torch.Tensor, group: Any) -> torch.Tensor:
    """``z`` (batch, heads, chunk, head_dim) of every rank of ``group``, concatenated along the sequence."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(z.contiguous(), group=group), dim=2)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn: Callable[[ModelConfig], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = ffn(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """``ffn``: each block's feed-forward (the SwiGLU MLP, or a mixture of experts)."""

    def __init__(self, cfg: ModelConfig, ffn: Callable[[ModelConfig], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keyed by index ("layers.0", as a list would name them): a pipeline stage keeps its own.
        self.layers = nn.ModuleDict({str(i): Block(cfg, ffn) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.norm is not None else h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
