"""Steps and phases of an unmodified script, from PyTorch's own global hooks.

Zero-code instrumentation (:mod:`rankwatch.hooks.instrument.zerocode`) has no ``mon.step()``
and no ``mon.mark()`` to read, so it takes the same facts from what every training loop does:

* **A step ends at an optimizer step** (``torch.optim`` global step post-hook) that follows
  a forward or a backward of the same step.  Gradient accumulation (several forward/backward
  pairs, one ``optimizer.step()``) is one step; several optimizers stepped one after the
  other (a Hugging Face-style loop) are one step, the later ones' time charged to the next
  step's data phase; an eval pass (forwards with gradients off, no optimizer) is no step.
  (Alternating updates that each run their own forward and backward, as a GAN's two players
  do, count one step per update.)  A step opens at its first forward or backward, dated
  from the end of the step before, so the wait for its batch is its ``data`` phase; between
  the two the rank shows the last step it finished.
* **Phases**, charged as ``Recorder.mark`` charges them, the time since the previous mark:
  ``data`` up to the first forward of the step (and between a backward and the next
  micro-batch's forward): the loader, and host work outside the model; ``forward`` from the
  root module's forward to the backward (the loss included); ``backward`` the backward through
  the root's output; ``optimizer`` from the end of the last backward to the end of the
  optimizer step (gradient clipping included).
* **Eval**: the root module called with gradients off marks the rank's activity ``eval`` (a
  longer hang allowance); if the step had no training work yet, its start moves past the
  eval forward, so evaluation is in no step's time.

The root module is the outermost call: a depth count over every module's forward.  During the
first step global forward hooks find the root modules (the models the loop calls); from its
end only those are hooked, so that no other module call pays for a hook.  A model first
called at the top level after the first step is not seen (its time falls in the phase around
it).  Every hook only reads a clock, compares and appends (the recorder's hot path).

The backward is seen without wrapping anything (no rankwatch frame in the user's tracebacks):
the root's forward hook puts a pre-hook on the autograd node of the first output tensor that
has one (a tensor, or the first of a tuple, list, dict or ``ModelOutput``); when the backward
reaches it, the backward has begun, and it queues an autograd final callback, which runs once
the graph has run (every gradient is ready) and queues a second, which runs after every
callback queued before it (DDP's and FSDP's, which wait for their reductions): the backward's
end.  A backward that never reaches the root's first output tensor is not seen (its time
falls in the phase around it).  DDP's reduction is timed there (:mod:`.ddp_timing`).
"""

from __future__ import annotations

import time
from typing import Any

from rankwatch.hooks.instrument.recorder import ACTIVITY_EVAL, ACTIVITY_TRAIN, Recorder

__all__ = ["StepHooks"]

_MAX_ROOTS = 16   # root modules hooked after the first step (models called at the top level)
# Where the step is: what the time since the last mark was spent on.
_IDLE, _FORWARD, _AFTER_FORWARD, _BACKWARD = 0, 1, 2, 3


class StepHooks:
    """The global hooks that turn a script's own calls into step records.

    Args:
        recorder: where steps and marks go.
        first_step: the number of the first step (1, or where a restarted job resumes).
        ddp: times DDP's reduction in each backward seen (a :class:`.ddp_timing.DdpTiming`), or None.
    """

    def __init__(self, recorder: Recorder, first_step: int = 1, ddp: Any = None) -> None:
        self._rec = recorder
        self._ddp = ddp
        self._step = first_step
        self._where = _IDLE
        self._depth = 0            # nested module forwards in progress
        self._in_backward = False  # a backward seen begin has not ended yet
        self._ready_ns = 0         # when the open backward's graph had run (every gradient ready)
        self._root: Any = None     # the root module whose call is in progress
        self._trained = False      # the open step had a forward or backward with gradients on
        self._open = False         # a step is open (each opens at its first training work)
        self._next_ns = 0          # when the next step began: the last one's end (0: not yet)
        self._root_eval = False    # the root call in progress runs with gradients off
        self._grad_enabled: Any = lambda: True
        self._handles: list[Any] = []          # the optimizer's global step hooks
        self._module_handles: list[Any] = []   # the forward hooks: global, then the roots' own
        self._discovering = True   # the first step: global forward hooks find the root modules
        self._roots: dict[int, Any] = {}
        self._tensor: Any = None
        self._queue_callback: Any = None
        self.steps = 0             # steps ended so far
        self.errors = 0            # bookkeeping errors (counted, never raised)

    # -- lifecycle ----------------------------------------------------------
    def install(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        self._module_handles = [
            nn_module.register_module_forward_pre_hook(self._forward_pre),
            nn_module.register_module_forward_hook(self._forward_post, always_call=True),
        ]
        self._handles = [
            optim.register_optimizer_step_pre_hook(self._optimizer_pre),
            optim.register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self._grad_enabled = torch.is_grad_enabled
        self._tensor = torch.Tensor
        self._queue_callback = torch.autograd.Variable._execution_engine.queue_callback

    def uninstall(self) -> None:
        for handle in (*self._handles, *self._module_handles):
            handle.remove()
        self._handles, self._module_handles = [], []
        self._roots.clear()
        self._root = None

    # -- the hooks (training thread) ----------------------------------------
    def _forward_pre(self, module: Any, _args: Any) -> None:
        depth = self._depth
        self._depth = depth + 1
        if depth or self._in_backward:   # (a forward inside a backward: a recompute)
            return
        if self._discovering and len(self._roots) < _MAX_ROOTS:
            self._roots[id(module)] = module
        self._root = module
        rec = self._rec
        if not self._grad_enabled():   # eval, or a no-grad model call inside a step
            self._root_eval = True
            if not self._trained:
                rec.activity = ACTIVITY_EVAL
            return
        if not self._open:
            self._begin(time.perf_counter_ns())
        elif rec.activity != ACTIVITY_TRAIN:
            rec.activity = ACTIVITY_TRAIN
        rec.mark("forward" if self._where == _AFTER_FORWARD else "data")
        self._where = _FORWARD
        self._trained = True

    def _forward_post(self, _module: Any, _args: Any, out: Any) -> None:
        depth = self._depth - 1
        self._depth = max(depth, 0)
        if depth > 0:
            return
        if self._root_eval:
            self._root_eval, self._root = False, None
            if not self._trained:   # eval before the step's training work: in no step's time
                self._next_ns = time.perf_counter_ns()
                if self._open:
                    self._rec.begin_step(self._step, self._next_ns)
                self._rec.activity = ACTIVITY_EVAL
            return
        if self._where == _FORWARD:
            self._rec.mark("forward")
            self._where = _AFTER_FORWARD
            self._watch_backward(out)

    def _watch_backward(self, out: Any) -> None:
        """Put the backward's pre-hook on the autograd node of ``out``'s first tensor."""
        try:
            node = _first_node(out, self._tensor)
            if node is not None:
                node.register_prehook(self._backward_pre)
        except Exception:  # noqa: BLE001 - never raise into training
            self.errors += 1

    def _backward_pre(self, _grads: Any) -> None:
        if self._in_backward or not self._handles:   # (not installed: a graph made before)
            return
        try:
            self._in_backward = True
            self._backward_begins()
            if self._ddp is not None:
                self._ddp.begin(self._root)
            self._root = None   # (held no longer than needed: a model alive at exit can abort gloo)
            self._queue_callback(self._graph_done)
        except Exception:  # noqa: BLE001
            self.errors += 1

    def _graph_done(self) -> None:
        """The autograd graph has run: every gradient is ready; the backward ends after the
        final callbacks queued before this one (DDP's, FSDP's) have waited for their reductions."""
        try:
            self._ready_ns = time.perf_counter_ns()
            self._queue_callback(self._backward_done)
        except Exception:  # noqa: BLE001
            self.errors += 1
            self._in_backward = False

    def _backward_done(self) -> None:
        try:
            self._in_backward = False
            end = time.perf_counter_ns()
            if self._ddp is not None and self._ddp.end(self._ready_ns, end):
                self._rec.blocked_ns += max(0, end - self._ready_ns)   # waited for DDP's buckets
            self._rec.mark("backward")
            self._where = _IDLE
        except Exception:  # noqa: BLE001
            self.errors += 1

    def _backward_begins(self) -> None:
        if not self._open:
            self._begin(time.perf_counter_ns())
        self._rec.mark("forward" if self._where == _AFTER_FORWARD else "data")
        self._where = _BACKWARD
        self._trained = True

    def _optimizer_pre(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._open:   # (closed: a second optimizer right after the first, the same update)
            self._rec.mark("optimizer" if self._where == _IDLE else "forward")

    def _optimizer_post(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._open:
            return
        rec = self._rec
        rec.mark("optimizer")
        self._where = _IDLE
        self._in_backward, self._root = False, None   # (a backward that raised never ended)
        if not self._trained:   # an optimizer step with no training work: not an update
            return
        rec.end_step()
        if self._discovering:
            self._settle()
        self.steps += 1
        self._step += 1
        self._trained = False
        self._open = False   # the next step opens at its first training work, dated from now
        self._next_ns = time.perf_counter_ns()

    def _settle(self) -> None:
        """The first step is over: hook only the root modules it called, and drop the global
        forward hooks (with any global hook, every module call takes PyTorch's slow path,
        ~3 us a call)."""
        self._discovering = False
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        for root in self._roots.values():
            self._module_handles += [root.register_forward_pre_hook(self._forward_pre),
                                     root.register_forward_hook(self._forward_post, always_call=True)]
        self._roots.clear()

    def _begin(self, now_ns: int) -> None:
        self._open = True
        self._rec.begin_step(self._step, self._next_ns or now_ns, since_last=bool(self._next_ns))


def _first_node(out: Any, tensor: type) -> Any:
    """The autograd node of ``out``'s first tensor that has one: ``out`` itself, or among the
    first values of a tuple, list, dict or ``ModelOutput``; None if none has."""
    if isinstance(out, tensor):
        return out.grad_fn
    if isinstance(out, dict):
        out = out.values()
    elif not isinstance(out, (tuple, list)):
        return None
    for i, value in enumerate(out):
        if i == 8:
            break
        if isinstance(value, tensor) and value.grad_fn is not None:
            return value.grad_fn
    return None
