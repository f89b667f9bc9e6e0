"""The harness's pipeline parallelism: which layers each stage holds, the stage's part of the
model, and one step of its schedule (``torch.distributed.pipelining``, GPipe or 1F1B).

A stage is the whole model with the other stages' parts removed (stage 0 keeps the
embedding, the last the norm and the output head), so its parameter names are the whole
model's and a checkpoint of every stage is the whole model's.  ``--pp-split`` sets the layers
per stage ("1,3": a head-heavy split), else they are spread evenly.

The stage is built with its shapes given (``input_args``, ``output_args`` and, in torch 2.13,
``input_grads``/``output_grads`` too: with only the first two the first stage's backward gets no
gradient, "grad can be implicitly created only for scalar outputs"), so no shape inference
runs at the first step.  The loss is the last stage's; it is summed over the ``pp`` group
after each step so every stage logs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Pipe", "split_layers", "stage_model"]


def split_layers(n_layers: int, stages: int, spec: str | None = None) -> list[list[int]]:
    """The layer indices of each stage: ``spec`` ("1,3") or an even spread (the first stages
    take one more when they do not divide).  Every stage holds at least one layer."""
    if spec:
        try:
            sizes = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"--pp-split {spec!r}: expected layers per stage, e.g. 1,3") from None
        if len(sizes) != stages or min(sizes) < 1:
            raise ValueError(f"--pp-split {spec!r}: {stages} stages of at least one layer each")
        if sum(sizes) != n_layers:
            raise ValueError(f"--pp-split {spec!r} holds {sum(sizes)} layers; the model has --layers {n_layers}")
    else:
        if n_layers < stages:
            raise ValueError(f"--pp {stages} needs at least {stages} layers (--layers {n_layers})")
        sizes = [n_layers // stages + (1 if s < n_layers % stages else 0) for s in range(stages)]
    out, at = [], 0
    for n in sizes:
        out.append(list(range(at, at + n)))
        at += n
    return out


def stage_model(model: nn.Module, stage: int, stages: int, layers: list[int]) -> nn.Module:
    """``model`` cut down in place to stage ``stage`` of ``stages``, holding ``layers``."""
    keep = {str(i) for i in layers}
    for name in [k for k in model.layers if k not in keep]:  # type: ignore[attr-defined]
        del model.layers[name]  # type: ignore[attr-defined]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = None
        model.output = None
    return model


@dataclass
class Pipe:
    """One stage's schedule, and what a step feeds it."""

    schedule: Any
    stage: int
    stages: int
    group: Any
    """The ``pp`` process group."""
    vocab: int
    batch_size: int = 0
    """Samples a step feeds it (its microbatches split them): the stage's shapes are built for it."""
    remake: Callable[[int], Pipe] | None = None
    """The same stage built for another batch size (a shrunk world keeps its global batch with
    smaller micro-batches; the microbatches become the greatest count that divides it)."""

    @classmethod
    def build(cls, model: nn.Module, stage: int, stages: int, group: Any, *, schedule: str, microbatches: int,
              batch_size: int, seq_len: int, dim: int, vocab: int, device: str) -> Pipe:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if microbatches < 1 or batch_size % microbatches:
            raise ValueError(f"--microbatches {microbatches} must divide --batch-size {batch_size}")
        mb = batch_size // microbatches
        act = torch.zeros(mb, seq_len, dim, device=device)
        first, last = stage == 0, stage == stages - 1
        inp = torch.zeros(mb, seq_len, dtype=torch.long, device=device) if first else act
        out = torch.zeros(mb, seq_len, vocab, device=device) if last else act
        pstage = PipelineStage(model, stage, stages, torch.device(device), input_args=(inp,), output_args=(out,),
                               input_grads=(None,) if first else (act,), output_grads=(None,) if last else (out,),
                               group=group)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(pstage, microbatches, loss_fn=lambda logits, target: F.cross_entropy(
            logits.reshape(-1, vocab), target.reshape(-1)))
        def remake(size: int) -> Pipe:
            return cls.build(model, stage, stages, group, schedule=schedule, microbatches=math.gcd(microbatches, size),
                             batch_size=size, seq_len=seq_len, dim=dim, vocab=vocab, device=device)

        return cls(schedule=sched, stage=stage, stages=stages, group=group, vocab=vocab, batch_size=batch_size,
                   remake=remake)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One step's forwards and backwards over the microbatches; the step's mean loss,
        the same on every stage (the last stage's, summed over the pp group)."""
        losses: list[torch.Tensor] = []
        if self.stage == 0:
            self.schedule.step(inputs, target=targets if self.stages == 1 else None)
        elif self.stage == self.stages - 1:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        loss = (torch.stack([x.detach().float() for x in losses]).mean() if losses
                else torch.zeros((), device=inputs.device))
        loss = loss.reshape(1)
        dist.all_reduce(loss, group=self.group)
        return loss[0]
