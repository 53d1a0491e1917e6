"""NCCL's semantics over ``tests/fake_pg.py``, for testing the GPU paths without a GPU.

:class:`FakeNcclGroup` wraps one rank's :class:`~fake_pg.FakeProcessGroup` and behaves
as ProcessGroupNCCL does where it differs from gloo:

* every tensor must be on the group's accelerator device (``meta`` stands in for
  ``cuda`` where no values are checked; ``cpu`` where they are), else the call
  raises at once, as NCCL refuses a CPU tensor;
* what NCCL lacks is refused: bitwise reductions and int16 (and other dtypes NCCL
  has no type for);
* completion is asynchronous: ``wait()`` returns at once (it only orders the
  caller's stream), the outputs are written when the collective completes "on
  the device", which a caller sees through ``is_completed()``; ``hang()`` makes
  every later collective never complete (a peer died inside the kernel);
* ``abort()`` ends the communicator: later calls and waits raise.

:class:`FakeNcclWorld` hands out one such group per rank, optionally wrapped by the
worker's :class:`CompletingGroup`, with the inner world's call counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from fake_pg import FakeProcessGroup, FakeWorld

from collectives_server.worker.engine.device_completion import CompletingGroup

__all__ = ["FakeNcclGroup", "FakeNcclWorld", "NCCL_DTYPES"]

# The dtypes ProcessGroupNCCL maps onto an NCCL type (bool travels as uint8).
NCCL_DTYPES = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.bool,
    }
)
_BITWISE = ("BAND", "BOR", "BXOR")


class _State:
    def __init__(self) -> None:
        self.hung = False
        self.aborted = False
        self.aborts = 0


class FakeNcclWork:
    """``wait()`` does not block the CPU; the outputs appear once the work completes."""

    def __init__(self, inner: Any, state: _State, land: Callable[[], None]) -> None:
        self._inner, self._state, self._land = inner, state, land
        self._hung = state.hung
        self._landed = False

    def _done(self) -> bool:
        if self._state.aborted:
            return True
        if self._hung or not self._inner.is_completed():
            return False
        if not self._landed:
            self._landed = True
            try:
                self._inner.wait(0)
            except BaseException:
                return True  # failed: nothing lands; wait() raises it
            self._land()
        return True

    def is_completed(self) -> bool:
        return self._done()

    def wait(self, timeout: Any = None) -> bool:
        if self._state.aborted:
            raise RuntimeError("[fake nccl] NCCL communicator was aborted")
        if not self._hung and self._inner.is_completed():
            self._inner.wait(0)  # the collective's error, if it failed; lands nothing
        return True


class FakeNcclGroup:
    """One rank's NCCL-like group over a fake gloo group (see the module docstring)."""

    def __init__(self, inner: FakeProcessGroup, device: torch.device, state: _State) -> None:
        self._inner, self.device, self._state = inner, device, state

    def name(self) -> str:
        return "nccl"

    def size(self) -> int:
        return self._inner.size()

    def rank(self) -> int:
        return self._inner.rank()

    def abort(self) -> None:
        self._state.aborted = True
        self._state.aborts += 1

    # ------------------------------------------------------------- checks
    def _check(self, method: str, tensors: Sequence[torch.Tensor], op: str = "") -> None:
        if self._state.aborted:
            raise RuntimeError(f"[fake nccl] {method}: the communicator was aborted")
        for t in tensors:
            if t.device != self.device:
                raise RuntimeError(
                    f"[fake nccl] {method}: Tensors must be on {self.device} and dense, "
                    f"got a tensor on {t.device}"
                )
            if t.dtype not in NCCL_DTYPES:
                raise RuntimeError(
                    f"[fake nccl] {method}: Unsupported data type for NCCL process group: {t.dtype}"
                )
        if op in _BITWISE:
            raise RuntimeError(f"[fake nccl] {method}: Cannot use ReduceOp.{op} with NCCL")

    def _work(self, inner: Any, land: Callable[[], None] = lambda: None) -> FakeNcclWork:
        return FakeNcclWork(inner, self._state, land)

    # --------------------------------------------------------- collectives
    def allreduce(
        self, tensors: Sequence[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> FakeNcclWork:
        opts = opts or dist.AllreduceOptions()
        self._check("allreduce", tensors, opts.reduceOp.op.name)
        (t,) = tensors
        staged = t.clone()
        inner = self._inner.allreduce([staged], opts)
        return self._work(inner, lambda: t.copy_(staged))

    def broadcast(
        self, tensors: Sequence[torch.Tensor], opts: dist.BroadcastOptions | None = None
    ) -> FakeNcclWork:
        self._check("broadcast", tensors)
        (t,) = tensors
        staged = t.clone()
        inner = self._inner.broadcast([staged], opts or dist.BroadcastOptions())
        return self._work(inner, lambda: t.copy_(staged))

    def allgather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
    ) -> FakeNcclWork:
        outs = list(output_tensors[0])
        self._check("allgather", [*outs, *input_tensors])
        staged = [o.clone() for o in outs]
        inner = self._inner.allgather([staged], input_tensors)
        return self._work(inner, lambda: [o.copy_(s) for o, s in zip(outs, staged, strict=True)])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> FakeNcclWork:
        self._check("_allgather_base", [output, input])
        staged = output.clone()
        inner = self._inner._allgather_base(staged, input)
        return self._work(inner, lambda: output.copy_(staged))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> FakeNcclWork:
        outs = list(output_tensors[0]) if output_tensors else []
        self._check("gather", [*outs, *input_tensors])
        staged = [o.clone() for o in outs]
        inner = self._inner.gather([staged] if output_tensors else [], input_tensors, opts)
        return self._work(inner, lambda: [o.copy_(s) for o, s in zip(outs, staged, strict=True)])

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> FakeNcclWork:
        self._check("alltoall_base", [output, input])
        staged = output.clone()
        inner = self._inner.alltoall_base(
            staged, input, output_split_sizes, input_split_sizes, opts
        )
        return self._work(inner, lambda: output.copy_(staged))

    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> FakeNcclWork:  # noqa: N803
        self._check("send", tensors)
        return self._work(self._inner.send([tensors[0].clone()], dstRank, tag))

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> FakeNcclWork:  # noqa: N803
        self._check("recv", tensors)
        (t,) = tensors
        staged = t.clone()
        inner = self._inner.recv([staged], srcRank, tag)
        return self._work(inner, lambda: t.copy_(staged))


class FakeNcclWorld:
    """N ranks' NCCL-like groups on ``device``; ``completing``: each wrapped by the
    worker's :class:`CompletingGroup` (as ``build_groups`` does), with ``timeout_s``."""

    def __init__(
        self,
        size: int,
        device: torch.device,
        completing: bool = True,
        timeout_s: float = 10.0,
    ) -> None:
        self.inner = FakeWorld(size, timeout_s)
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        self.states = [_State() for _ in range(size)]
        self._groups = [
            FakeNcclGroup(self.inner.pg(r), device, self.states[r]) for r in range(size)
        ]
        self._completing = completing

    @property
    def calls(self) -> list[Any]:
        return self.inner.calls

    def raw(self, rank: int) -> FakeNcclGroup:
        return self._groups[rank]

    def pg(self, rank: int) -> Any:
        group = self._groups[rank]
        return CompletingGroup(group, self.timeout_s) if self._completing else group

    def hang(self, rank: int) -> None:
        """``rank``'s later collectives never complete on its device."""
        self.states[rank].hung = True
