"""Model versions on one rank: which weights a forward runs, and how a publish commits.

Every hosted model has an integer ``version`` (1 after loading). A publish
(``handlers/publish_ops``) stages the new weights beside the live ones and
commits them here, under the model's lock, at the publish's place in the op
order: the module's parameters and buffers are *replaced* by the staged tensors
(``load_state_dict(assign=True)``), never written in place. So:

* a forward holds the model's lock while it runs (shared with other forwards
  that only read the model, :mod:`model_lock`), and so runs on one version from
  start to end (a commit waits for it);
* a graph retained by a forward keeps the parameters of its version alive
  (autograd holds them), and its backward computes with the weights its forward
  used. Those are the only way an older version stays resident: a publish
  refuses to stage a third version while graphs of an older one are retained
  (:func:`older_graphs`), so at most two versions are ever resident;
* the optimizer, if any, is moved onto the new parameters with its state
  (momentum, moments) kept, as if the parameters had been assigned in place;
  so are the gradients accumulated so far (``load_state_dict`` keeps ``.grad``),
  and a backward through a graph of an older version adds its parameters'
  gradients to the model's (:func:`carry_gradients`).

A forward names the version it needs (:func:`serving`): 0 for whatever this
rank serves, or an exact version. A version another rank already committed is
waited for (its commit is in flight here); one this rank moved past is refused
with ABORTED (``Reason.VERSION_MOVED``), and the SDK runs the call again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
from torch import nn

from collectives.errors import (
    CollectiveError,
    DeadlineExceeded,
    InvalidArgument,
    Reason,
    ResourceExhausted,
    error_for_code,
)
from collectives_server.worker.data.store import TensorStore
from collectives_server.worker.models.registry import HostedModel

__all__ = [
    "Entry",
    "bump",
    "carry_gradients",
    "check_entries",
    "commit",
    "drop_reusable",
    "keep_for_reuse",
    "older_graphs",
    "prepare",
    "presence_error",
    "reusing",
    "serving",
]


@dataclass(frozen=True)
class Entry:
    """One state dict entry of a publish, as it travels."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@contextlib.contextmanager
def serving(
    model: HostedModel,
    wanted: int,
    deadline: float,
    training: bool | None = None,
    *,
    shared: bool = False,
) -> Iterator[tuple[int, nn.Module]]:
    """Holds the model's lock at version ``wanted`` (0: the current one); yields that
    version and the module to call in ``training`` mode (None: the model's own).

    ``shared``: for a forward that only reads the model (no autograd, eval mode), which
    may run beside other such forwards (:mod:`model_lock`); else the lock is held
    exclusively.

    Raises:
        DeadlineExceeded: ``wanted`` was not committed here before ``deadline``.
        CollectiveError: ABORTED (``Reason.VERSION_MOVED``) if this rank is past it.
        FailedPrecondition: the model cannot run in that mode.
    """
    lock = model.lock
    if not shared:
        with lock:
            _await_version(model, wanted, deadline, exclusive=True)
            yield model.version, model.runnable(training)
        return
    mode = bool(model.training if training is None else training)
    with lock.admitted():
        _await_version(model, wanted, deadline, exclusive=False)
        module = model.runnable_as_is(mode)
        if module is None:
            lock.drain()  # the model must change (its mode): nobody may be running it
            module = model.runnable(mode)
        version = model.version
        lock.join()
    try:
        yield version, module
    finally:
        lock.leave()


def _await_version(model: HostedModel, wanted: int, deadline: float, exclusive: bool) -> None:
    while wanted and model.version < wanted:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                f"model {model.name!r} is at version {model.version} on this rank; "
                f"version {wanted} was not committed here in time"
            )
        model.lock.wait(left, exclusive=exclusive)
    if wanted and model.version != wanted:
        raise error_for_code(
            grpc.StatusCode.ABORTED,
            f"model {model.name!r} moved from version {wanted} to {model.version} on "
            "this rank while the call ran; run it again",
            reason=Reason.VERSION_MOVED,
        )


def presence_error(
    name: str, present: Sequence[bool], signatures: Sequence[object]
) -> CollectiveError | None:
    """The error of a sequenced model op when the model is not loaded, or not the same,
    on every rank (each rank's presence and parameter signature, by rank); None if it is."""
    missing = [r for r, here in enumerate(present) if not here]
    if len(missing) == len(present):
        not_found = grpc.StatusCode.NOT_FOUND
        return error_for_code(not_found, f"model {name!r} is not loaded on any rank")
    if missing:
        return error_for_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {name!r} is missing on rank(s) {', '.join(map(str, missing))}; "
            "load_model it again so every worker has it",
            ranks=missing,
        )
    if len(set(signatures)) > 1:
        return error_for_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"model {name!r} is not the same on every rank: different parameters, or "
            "different loads (two load_model calls of it raced, and each reached some "
            "ranks last); load it again",
        )
    return None


def bump(model: HostedModel) -> int:
    """The weights changed in place (an optimizer step): the next version. Caller holds
    the lock."""
    with model.lock:
        model.version += 1
        model.lock.notify_all()
        return model.version


def older_graphs(model: HostedModel) -> int:
    """Retained graphs holding a version older than the live one (caller holds the lock)."""
    return sum(1 for g in model.graphs.values() if g.version < model.version)


def check_entries(
    model: HostedModel, entries: Sequence[Entry], strict: bool, cast: bool
) -> CollectiveError | None:
    """Whether ``entries`` can replace the model's weights (None) or why not, worded as
    ``nn.Module.load_state_dict`` would. The caller holds the model's lock."""
    current = model.module.state_dict()
    keys = [e.key for e in entries]
    unknown = sorted(set(keys) - set(current))
    missing = sorted(set(current) - set(keys)) if strict else []
    if unknown or missing:
        return InvalidArgument(
            f"state dict keys do not match model {model.name!r}: unexpected {unknown[:5]}, "
            f"missing {missing[:5]}"
            + (" (strict=False loads a subset of the keys)" if missing else "")
        )
    if len(set(keys)) != len(keys):
        return InvalidArgument("the state dict names a key twice")
    for e in entries:
        have = current[e.key]
        if tuple(have.shape) != e.shape:
            return InvalidArgument(
                f"state dict entry {e.key!r} has shape {list(e.shape)}; "
                f"the model has {list(have.shape)}"
            )
        if have.dtype != e.dtype and not cast:
            return InvalidArgument(
                f"state dict entry {e.key!r} is {e.dtype}; the model holds {have.dtype} "
                "(cast=True converts it)"
            )
    return None


def prepare(model: HostedModel, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The staged tensors: each received one on its entry's device, in its dtype (a copy
    only where they differ). Raises what torch raises on a failed cast or move."""
    current = model.module.state_dict()
    return {k: t.to(device=current[k].device, dtype=current[k].dtype) for k, t in received.items()}


def commit(model: HostedModel, staged: dict[str, torch.Tensor], version: int) -> list[torch.Tensor]:
    """Makes ``staged`` the live weights at ``version`` (the caller holds the lock); returns
    the tensors it replaced.

    Parameters and buffers are replaced, not overwritten, so retained graphs keep
    the weights they were computed with; the optimizer follows its parameters."""
    current = model.module.state_dict()
    if set(staged) >= set(current):
        model.replicas_may_differ = False  # every rank now holds the same weights
    replaced = [current[k].detach() for k in staged if current[k] is not staged[k]]
    before = dict(model.module.named_parameters())
    model.module.load_state_dict(staged, strict=False, assign=True)
    after = dict(model.module.named_parameters())
    moved = {id(before[n]): after[n] for n in before if after.get(n) is not before[n]}
    if model.optimizer is not None and moved:
        _move_optimizer(model.optimizer, moved)
    for key, old in before.items():
        new = after.get(key)
        if new is not None and new is not old and old.grad is not None:
            new.grad, old.grad = old.grad.detach(), None
    with model.lock:
        model.version = version
        model.lock.notify_all()
    return replaced


def carry_gradients(model: HostedModel, used: dict[str, nn.Parameter]) -> None:
    """After a backward through a graph whose forward ran on the parameters ``used``
    (by name): those no longer the model's (a publish replaced them) hand the gradients
    the backward left on them to the model's parameters, added to what these hold (the
    caller holds the lock)."""
    current = model.parameters
    arena = model.grad_arena()
    for i, (key, param) in enumerate(current):
        old = used.get(key)
        if old is None or old is param or old.grad is None:
            continue
        arena.adopt(i)
        param.grad.add_(old.grad.to(param.grad.dtype))
        old.grad = None


def keep_for_reuse(model: HostedModel, replaced: list[torch.Tensor], store: TensorStore) -> None:
    """Keeps the replaced weights' memory for the next publish to receive into (the
    caller holds the lock and knows no retained graph holds them): memory already
    faulted in is several times faster to receive into than fresh pages. Counted
    against the store's quota; not kept if it does not fit."""
    drop_reusable(model)
    nbytes = sum(t.numel() * t.element_size() for t in replaced)
    if not nbytes:
        return
    try:
        reservation = store.reserve(f"model {model.name} (previous weights)", nbytes, "model")
    except ResourceExhausted:
        return
    model.reusable = [t for t in replaced if t.is_contiguous() and t.storage_offset() == 0]
    model.reusable_reservation = reservation


def drop_reusable(model: HostedModel) -> list[torch.Tensor]:
    """Takes the kept memory back (and its quota); returns it for the caller to use."""
    kept, model.reusable = model.reusable, []
    if model.reusable_reservation is not None:
        model.reusable_reservation.release()
        model.reusable_reservation = None
    return kept


def reusing(
    kept: list[torch.Tensor],
) -> Callable[[Sequence[int], torch.dtype, torch.device], torch.Tensor]:
    """An allocator handing out ``kept`` memory of exactly the size asked, else fresh."""

    def alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        for i, t in enumerate(kept):
            storage = t.untyped_storage()
            if t.device == device and storage.nbytes() == nbytes:
                del kept[i]
                return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape))
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    return alloc


def _move_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, torch.Tensor]) -> None:
    """Points the optimizer's groups and state at the replacing parameters."""
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    state = optimizer.state
    for old in [p for p in state if id(p) in moved]:
        state[moved[id(old)]] = state.pop(old)
