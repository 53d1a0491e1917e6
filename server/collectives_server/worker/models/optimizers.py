"""Which optimizer a hosted model steps with: one rule for ``Step`` and for ``train_step``.

Both the per-worker ``Step`` RPC (``model_service.py``) and the leader-sequenced
``train_step`` op (``handlers/model_ops.py``) name an optimizer kind and its
hyperparameters on every call. :func:`plan_optimizer` decides what that means
for the model's current optimizer, and :func:`install` makes it so:

* no optimizer yet, or a **different kind**: a fresh optimizer, with fresh
  state (no momentum buffers, no Adam moments, step count 0);
* the **same kind with the same hyperparameters**: the current optimizer,
  untouched;
* the **same kind with new hyperparameters**: the current optimizer keeps its
  per-parameter state (momentum buffers, moments, step counts) and takes the
  new hyperparameters, exactly as assigning ``param_groups[i]["lr"]`` does in
  torch (an lr schedule does not reset momentum). The hyperparameters sent are
  the whole set: one left out takes the kind's default, as in
  ``torch.optim.SGD(params, **hyper)``, not its previous value;
* except that switching ``amsgrad`` on starts fresh: the current state has no
  ``max_exp_avg_sq``, and torch's step would fail on it.

Planning builds (and so validates) the new optimizer or settings without
touching the model, so a sequenced op can plan before its outcome agreement and
install only once every rank agreed; a plan that is never installed leaves the
model as it was. The caller holds ``model.lock`` from plan to install.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives.errors import InvalidArgument
from collectives_server.worker.models.registry import HostedModel

__all__ = [
    "OPTIMIZERS",
    "OptimizerPlan",
    "check_max_grad_norm",
    "clip_gradients",
    "install",
    "make_optimizer",
    "plan_optimizer",
]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}

# Settings whose state the other value lacks: changing them starts fresh.
_STATE_SHAPING = ("amsgrad",)


@dataclass(frozen=True)
class OptimizerPlan:
    """What :func:`install` does: the optimizer that will step, and how it gets there."""

    kind: str
    hyper: dict[str, Any]
    # The optimizer that steps once installed: a fresh one, or the model's current one.
    optimizer: torch.optim.Optimizer
    # The model's optimizer when the plan was made (None: it had none).
    base: torch.optim.Optimizer | None
    # Param-group settings to give the current optimizer (same kind, new hyperparameters).
    settings: tuple[dict[str, Any], ...] = field(default=())

    @property
    def fresh(self) -> bool:
        """True when the plan replaces the optimizer (and so its state)."""
        return self.optimizer is not self.base


def make_optimizer(model: HostedModel, kind: str, hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """A new optimizer of ``kind`` over the model's parameters; INVALID_ARGUMENT if
    the kind is unknown or torch rejects the hyperparameters."""
    cls = OPTIMIZERS.get(kind)
    if cls is None:
        raise InvalidArgument(f"unknown optimizer {kind!r}; use one of: {', '.join(OPTIMIZERS)}")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(hyper) - accepted)
    if unknown:
        raise InvalidArgument(
            f"optimizer {kind} does not take {', '.join(unknown)}; it accepts: "
            + ", ".join(sorted(accepted))
        )
    try:
        return cls(model.module.parameters(), **hyper)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"optimizer {kind}: {exc}") from None


def plan_optimizer(model: HostedModel, kind: str, hyper: dict[str, Any]) -> OptimizerPlan:
    """The optimizer ``model`` should step with for ``kind`` and ``hyper`` (see the
    module docstring); builds nothing into the model. Raises InvalidArgument."""
    current = model.optimizer
    if current is not None and kind == model.optimizer_kind and hyper == model.optimizer_hyper:
        return OptimizerPlan(kind, dict(hyper), current, current)
    candidate = make_optimizer(model, kind, hyper)  # validates, even when only settings are kept
    if current is None or kind != model.optimizer_kind:
        return OptimizerPlan(kind, dict(hyper), candidate, current)
    settings = tuple(
        {k: v for k, v in group.items() if k != "params"} for group in candidate.param_groups
    )
    reshaped = any(
        old.get(key) != new.get(key)
        for old, new in zip(current.param_groups, settings, strict=False)
        for key in _STATE_SHAPING
    )
    if reshaped or len(settings) != len(current.param_groups):
        return OptimizerPlan(kind, dict(hyper), candidate, current)
    return OptimizerPlan(kind, dict(hyper), current, current, settings)


def install(model: HostedModel, plan: OptimizerPlan) -> torch.optim.Optimizer:
    """Makes ``plan`` the model's optimizer; returns it. The caller holds ``model.lock``
    and made ``plan`` under it (RuntimeError if the optimizer changed since)."""
    if model.optimizer is not plan.base:
        raise RuntimeError(f"model {model.name!r}: its optimizer changed since the plan was made")
    for group, setting in zip(plan.optimizer.param_groups, plan.settings, strict=False):
        group.update(setting)
    model.optimizer = plan.optimizer
    model.optimizer_kind = plan.kind
    model.optimizer_hyper = dict(plan.hyper)
    return plan.optimizer


def check_max_grad_norm(max_grad_norm: float) -> None:
    """Refuses a clipping norm that is negative or not finite (0: no clipping).

    Raises:
        InvalidArgument: ``max_grad_norm`` is negative, NaN or infinite.
    """
    if not math.isfinite(max_grad_norm) or max_grad_norm < 0:
        raise InvalidArgument(
            f"max_grad_norm must be a finite number >= 0 (0: no clipping), got {max_grad_norm}"
        )


def clip_gradients(model: HostedModel, max_grad_norm: float) -> None:
    """Scales the model's gradients so their total 2-norm is at most ``max_grad_norm``,
    as ``torch.nn.utils.clip_grad_norm_`` does (0: leaves them). The caller holds
    ``model.lock``; after a gradient reduction every rank holds the same gradients,
    so every rank clips them alike."""
    if max_grad_norm > 0:
        grads = [p for _, p in model.parameters if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_grad_norm)
