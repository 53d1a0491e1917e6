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
* ``abort()`` ends the communicator: later calls and waits raise;
* point to point runs on the rank's one stream: a ``send`` or ``recv`` issued
  alone starts only once the rank's earlier point-to-point work completed, and
  a send completes only once its matching receive has started, so a ring shift
  of blocking sends hangs as it does on NCCL; what is issued between
  ``_start_coalescing`` and ``_end_coalescing`` starts together (NCCL's group
  call, ``batch_isend_irecv``), and ``_end_coalescing`` returns its one work;
* a communicator is split as ``ncclCommSplit`` does: collectively over the
  parent, every rank taking part, the ranks giving one color getting a new
  world, the others (``perform_nocolor_split``) nothing; a rank that never
  takes part leaves the others waiting until the world's timeout.

:class:`FakeNcclWorld` hands out one such group per rank, optionally wrapped by the
worker's :class:`CompletingGroup`, with the inner world's call counters.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from fake_pg import FakeProcessGroup, FakeWorld

from collectives_server.worker.engine.device_completion import CompletingGroup

__all__ = ["FakeNcclGroup", "FakeNcclWorld", "NCCL_DTYPES", "NOCOLOR", "split_factory"]

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
NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR: takes part in a split, joins no new communicator


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

    supports_splitting = True

    def __init__(
        self,
        inner: FakeProcessGroup,
        device: torch.device,
        state: _State,
        splitter: Callable[[int], FakeNcclGroup | None],
    ) -> None:
        self._inner, self.device, self._state = inner, device, state
        self._splitter = splitter
        self._stream: deque[_Launch] = deque()  # point-to-point launches, in issue order
        self._coalescing: _Launch | None = None

    def name(self) -> str:
        return "nccl"

    def size(self) -> int:
        return self._inner.size()

    def rank(self) -> int:
        return self._inner.rank()

    @property
    def aborted(self) -> bool:
        return self._state.aborted

    def abort(self) -> None:
        self._state.aborted = True
        self._state.aborts += 1

    # ------------------------------------------------------------- splits
    def split(self, color: int) -> FakeNcclGroup:
        """This rank's communicator of the ranks splitting with ``color`` (what
        ProcessGroupNCCL does on first use when its options name ``split_from``)."""
        if self._state.aborted:
            raise RuntimeError("[fake nccl] split: the parent communicator was aborted")
        made = self._splitter(color)
        assert made is not None
        return made

    def perform_nocolor_split(self, device: torch.device) -> None:
        if torch.device(device) != self.device:
            raise RuntimeError(f"[fake nccl] split on {device}, communicator on {self.device}")
        if self._state.aborted:
            raise RuntimeError("[fake nccl] split: the parent communicator was aborted")
        self._splitter(NOCOLOR)

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

    # ---------------------------------------------------- point to point
    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> Any:  # noqa: N803
        self._check("send", tensors)
        staged = tensors[0].clone()
        return self._p2p(lambda: self._inner.send([staged], dstRank, tag), lambda: None)

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        self._check("recv", tensors)
        (t,) = tensors
        staged = t.clone()
        return self._p2p(lambda: self._inner.recv([staged], srcRank, tag), lambda: t.copy_(staged))

    def _start_coalescing(self, device: torch.device) -> None:
        if self._coalescing is not None:
            raise RuntimeError("[fake nccl] _start_coalescing: already coalescing")
        if torch.device(device) != self.device:
            raise RuntimeError(f"[fake nccl] _start_coalescing on {device}, group on {self.device}")
        self._coalescing = _Launch()

    def _end_coalescing(self, device: torch.device) -> _LaunchWork:
        launch, self._coalescing = self._coalescing, None
        if launch is None:
            raise RuntimeError("[fake nccl] _end_coalescing without _start_coalescing")
        return self._enqueue(launch)

    def _p2p(self, issue: Callable[[], Any], land: Callable[[], None]) -> _LaunchWork:
        if self._coalescing is not None:
            self._coalescing.ops.append((issue, land))
            return _LaunchWork(self, self._coalescing)  # NCCL's per-op work in a group
        launch = _Launch()
        launch.ops.append((issue, land))
        return self._enqueue(launch)

    def _enqueue(self, launch: _Launch) -> _LaunchWork:
        self._stream.append(launch)
        self.progress()
        return _LaunchWork(self, launch)

    def progress(self) -> None:
        """Starts the stream's head launch, retires it once every op in it completed,
        and goes on to the next: one launch at a time, in issue order."""
        while self._stream and not self._state.hung:
            head = self._stream[0]
            if head.works is None:
                head.works = [issue() for issue, _ in head.ops]
            if not all(w.is_completed() for w in head.works):
                return
            for work in head.works:
                try:
                    work.wait(0)
                except BaseException as exc:  # the launch's error, raised at wait
                    head.error = head.error or exc
            if head.error is None:
                for _, land in head.ops:
                    land()
            head.done = True
            self._stream.popleft()


class _Launch:
    """Point-to-point ops NCCL launches together: one alone, or a coalesced group."""

    def __init__(self) -> None:
        self.ops: list[tuple[Callable[[], Any], Callable[[], None]]] = []
        self.works: list[Any] | None = None  # the inner ops, once started
        self.done = False
        self.error: BaseException | None = None


class _LaunchWork:
    """A launch's work: complete once the launch retired from the stream."""

    def __init__(self, group: FakeNcclGroup, launch: _Launch) -> None:
        self._group, self._launch = group, launch

    def is_completed(self) -> bool:
        if self._group.aborted:
            return True
        self._group.progress()
        return self._launch.done

    def wait(self, timeout: Any = None) -> bool:
        if self._group.aborted:
            raise RuntimeError("[fake nccl] NCCL communicator was aborted")
        self._group.progress()
        if self._launch.done and self._launch.error is not None:
            raise self._launch.error
        return True


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
            FakeNcclGroup(
                self.inner.pg(r), device, self.states[r], lambda color, r=r: self._split(r, color)
            )
            for r in range(size)
        ]
        self._completing = completing
        self.splits: list[list[int]] = [[] for _ in range(size)]  # each rank's split colors
        self.subs: dict[tuple[int, int], FakeNcclWorld] = {}  # (split number, color) -> world
        self._lock = threading.Lock()

    def _split(self, rank: int, color: int) -> FakeNcclGroup | None:
        """One rank's part in a split: waits for every rank's color (on the inner world,
        with its timeout); the ranks of ``color`` share one new world."""
        mine = torch.tensor([color], dtype=torch.int64)
        colors = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self.inner.pg(rank).allgather([colors], [mine]).wait()
        with self._lock:
            self.splits[rank].append(color)
            if color == NOCOLOR:
                return None
            members = [r for r, c in enumerate(colors) if int(c) == color]
            key = (len(self.splits[rank]), color)
            if key not in self.subs:
                self.subs[key] = FakeNcclWorld(
                    len(members), self.device, completing=False, timeout_s=self.timeout_s
                )
            return self.subs[key].raw(members.index(rank))

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


def split_factory(
    store: Any, rank: int, size: int, timeout_s: float, device: torch.device, split: Any
) -> FakeNcclGroup:
    """An NCCL factory (``process_groups.NcclFactory``) for sub-groups of a fake world:
    each is split from the world's fake communicator named by ``split``."""
    assert split is not None, "a sub-group of a fake NCCL world is always split"
    return split.parent.split(split.color)
