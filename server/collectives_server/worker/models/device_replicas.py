"""One copy of a model per local GPU, kept while its weights are unchanged.

``nn.parallel.data_parallel`` (``torch.nn.DataParallel``) copies every parameter
and buffer to every device on every call, so that gradients flow back to the
module's own parameters. A forward that reads the model (no autograd, eval
mode) needs none of that: :class:`DeviceReplicas` makes the copies once and
reuses them until a weight changes. A change is seen, not announced: the copies
are keyed by the identity and in-place version counter of every parameter and
buffer of the module called (an optimizer step, ``load_state_dict``, a publish
that swaps tensors, all bump or replace one), so no path that changes weights
can leave a stale copy behind. A call that records a graph or runs in train mode
goes through ``data_parallel`` as before.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["DeviceReplicas", "Weights"]

# Copies of the module on devices (the first shares the module's own tensors).
Replicate = Callable[[nn.Module, list[int]], list[nn.Module]]

# Models called through one DeviceReplicas at once (versions served side by side).
_KEPT = 2


class Weights:
    """What a module's copies were made from: the module, each of its parameters and
    buffers (held, so that no identity is reused while the copies are kept) and their
    in-place version counters (which autograd keeps for the same reason)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tensors = list(itertools.chain(module.parameters(), module.buffers()))
        self.versions = [t._version for t in self.tensors]

    def same_as(self, other: Weights) -> bool:
        return (
            self.module is other.module
            and len(self.tensors) == len(other.tensors)
            and all(a is b for a, b in zip(self.tensors, other.tensors, strict=True))
            and self.versions == other.versions
        )


def _replicate(module: nn.Module, device_ids: list[int]) -> list[nn.Module]:
    return nn.parallel.replicate(module, device_ids, detach=True)


class DeviceReplicas:
    """A model's copies on ``device_ids`` for forwards that only read it."""

    def __init__(self, device_ids: list[int], replicate: Replicate = _replicate) -> None:
        self.device_ids = device_ids
        self._replicate = replicate
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, tuple[Weights, list[nn.Module]]] = OrderedDict()
        self.made = 0  # how many times copies were made (each a broadcast of the weights)

    def copies(self, module: nn.Module) -> list[nn.Module]:
        """``module`` on every device: the kept copies while its weights are the same."""
        now = Weights(module)
        with self._lock:
            kept = self._kept.get(id(module))
            if kept is not None and kept[0].same_as(now):
                self._kept.move_to_end(id(module))
                return kept[1]
        with torch.no_grad():
            made = self._replicate(module, self.device_ids)
        with self._lock:
            self._kept[id(module)] = (now, made)
            self._kept.move_to_end(id(module))
            while len(self._kept) > _KEPT:
                self._kept.popitem(last=False)
            self.made += 1
        return made

    def run(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module(*args, **kwargs)`` split over the devices as ``data_parallel`` does
        (dim 0), on the kept copies, gathered on the first device."""
        inputs, kwargs_per = nn.parallel.scatter_gather.scatter_kwargs(
            args, kwargs, self.device_ids, 0
        )
        if not inputs and not kwargs_per:
            inputs, kwargs_per = ((),), ({},)
        used = len(inputs)
        outputs = nn.parallel.parallel_apply(
            self.copies(module)[:used], inputs, kwargs_per, self.device_ids[:used]
        )
        return nn.parallel.gather(outputs, self.device_ids[0])

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
