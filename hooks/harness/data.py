"""Synthetic token data, sharded over data-parallel ranks and resumable by step."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ShardedSampler", "SyntheticTokens", "build_loader"]


class SyntheticTokens(Dataset):
    """``size`` deterministic random sequences of ``seq_len + 1`` tokens."""

    def __init__(self, vocab_size: int, seq_len: int, size: int = 1 << 20, seed: int = 0) -> None:
        self.vocab_size, self.seq_len, self.size, self.seed = vocab_size, seq_len, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


class ShardedSampler(Sampler[int]):
    """DistributedSampler-style striding over dp ranks, starting at a global sample.

    Every TP rank of a dp group reads the same samples.  ``start`` is the number
    of samples the whole job has consumed, so a resume at another dp degree
    continues from the same place in the stream.
    """

    def __init__(self, size: int, dp_rank: int, dp_size: int, start: int = 0) -> None:
        self.size, self.dp_rank, self.dp_size, self.start = size, dp_rank, dp_size, start

    def __iter__(self) -> Iterator[int]:
        i = self.start + self.dp_rank
        while True:
            yield i % self.size
            i += self.dp_size

    def __len__(self) -> int:
        return self.size // self.dp_size


def build_loader(ds: SyntheticTokens, batch_size: int, dp_rank: int, dp_size: int,
                 start_sample: int) -> DataLoader:
    sampler = ShardedSampler(len(ds), dp_rank, dp_size, start=start_sample)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=0)
