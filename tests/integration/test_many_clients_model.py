"""Many clients, one cluster: a stateful property test against a pure-torch model of it.

Three client connections (separate ``collectives.connect`` objects) drive one
real local cluster through interleaved named-tensor puts and gets, collectives,
model loads (with and without batching), ``DataParallel`` forwards with and
without autograd on handles of different clients, backwards, gradient
reductions, ``train_step``, ``step``, ``zero_grad``, publishes and mode switches.
The reference below holds what the cluster must hold: every rank's named
tensors, every rank's model weights *and* buffers (batch norm running
statistics), gradients, versions, the recorded mode, and each handle's own mode;
every answer is compared with it, or must be one of the errors the contract
allows for that call (docs/api.md, docs/training.md):

1. named tensors, model weights, versions, gradients and batching are shared by
   every client; version 1 after load, +1 per publish, step, train_step with an
   optimizer;
2. ``ModelInfo.training`` is the loaded module's ``.training``, changed only by
   ``set_model_mode`` (and ``dp.train()``/``dp.eval()``);
3. a ``DataParallel`` handle takes the recorded mode at its first use and keeps
   its own; every forward runs in its handle's mode;
4. ``train_step`` runs in train mode everywhere and does not touch the recorded
   mode; its loss and gradient are the full batch's, weighted by shard sizes;
5. forwards split with ``torch.chunk`` over the world, except train-mode forwards
   of a model with batch norm: ``torch.chunk`` over as many workers as keep every
   shard at 2 rows or more (a 1-row batch on rank 0, which a train-mode batch
   norm refuses with ``InvalidArgument`` and no state change);
6. each rank's running statistics follow the shards it ran in train mode;
7. a dp backward accumulates each shard's part; ``all_reduce_gradients`` sums
   (or averages, refused from any client while unreduced dp-backward gradients
   are on the workers); ``step`` is per-rank SGD on each rank's own gradients.

The dropout model (p=0.5) is random in train mode: its train-mode outputs are
checked row by row to be the output of *some* dropout mask over the exactly
predicted hidden layer (batch norm sits before the dropout, so its running
statistics stay exact), and it is never trained through a random forward.

Replaying: the hypothesis seed is printed (derived from ``COLLECTIVES_TEST_SEED``,
or forced with ``COLLECTIVES_MODEL_TEST_SEED``); hypothesis prints the failing
steps and a blob that ``COLLECTIVES_MODEL_TEST_REPRODUCE=<blob>`` replays. The
bounded run (12 examples of up to 50 steps; each run draws a new seed, so runs
add up) reports a failure as found, since shrinking takes minutes;
``COLLECTIVES_MODEL_TEST_SHRINK=1`` shrinks it. A long run (soak, bench):

    COLLECTIVES_MODEL_TEST_EXAMPLES=200 COLLECTIVES_MODEL_TEST_STEPS=60 \
    COLLECTIVES_MODEL_TEST_TIMEOUT_S=3600 .venv/bin/python -m pytest -s \
        tests/integration/test_many_clients_model.py -k against_the_reference

(``COLLECTIVES_MODEL_TEST_WORKERS`` sets the cluster's size, default 3;
``COLLECTIVES_MODEL_TEST_VERBOSE=1`` prints every step.) The plain tests at the
end are the failures the machine found, one per defect, minimal.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
import torch
from helpers import connect_ready, reduce_oracle
from hypothesis import HealthCheck, Phase, Verbosity, reproduce_failure, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torch import nn
from torch.nn import functional

import collectives

TIMEOUT = 30.0
WORKERS = int(os.environ.get("COLLECTIVES_MODEL_TEST_WORKERS", "3"))
CLIENTS = 3
EXAMPLES = int(os.environ.get("COLLECTIVES_MODEL_TEST_EXAMPLES", "12"))
STEPS = int(os.environ.get("COLLECTIVES_MODEL_TEST_STEPS", "50"))
SHRINK = os.environ.get("COLLECTIVES_MODEL_TEST_SHRINK") == "1"
VERBOSE = os.environ.get("COLLECTIVES_MODEL_TEST_VERBOSE") == "1"  # print every step
# Float32 on shards of other shapes than the reference's: rounding only.
TOL = {"rtol": 1e-4, "atol": 1e-5}
# How many times the reference's own float32 rounding (float32 against float64 on the
# same inputs) a gradient may stray where that rounding exceeds TOL. That rounding is
# taken per parameter tensor, as its largest element's: an element's own difference
# is one sample of it, which can fall near zero by chance where another float32
# computation of the same ill-conditioned element (other shards, another summation
# order) strays as far as its neighbours do.
SLACK_FACTOR = 8

KINDS = ("drop", "det", "plain")
DROPOUT_P = {"drop": 0.5, "det": 0.0, "plain": 0.0}
TENSOR_TAGS = ("a", "b", "tx", "ty", "g")
SHAPES = ((4,), (2, 3))
SEEDS = st.integers(0, 2**31 - 1)
LRS = st.sampled_from((0.05, 0.1, 0.2))
ROWS_PER_RANK = st.sampled_from((0, 2, 3, 4))


def build(kind: str) -> nn.Sequential:
    """The three models: Linear(6,8) -> BatchNorm1d(8) (Tanh for "plain") ->
    Dropout(p) -> Linear(8,3), with fixed initial weights per kind."""
    torch.manual_seed(KINDS.index(kind) + 11)
    middle = nn.Tanh() if kind == "plain" else nn.BatchNorm1d(8)
    return nn.Sequential(nn.Linear(6, 8), middle, nn.Dropout(DROPOUT_P[kind]), nn.Linear(8, 3))


def random_state(kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A full state dict of fresh random values (running stats included)."""
    state = {}
    for key, value in build(kind).state_dict().items():
        if key.endswith("num_batches_tracked"):
            state[key] = torch.randint(0, 50, (), generator=gen, dtype=value.dtype)
        elif key.endswith("running_var"):
            state[key] = torch.rand(value.shape, generator=gen) + 0.5
        else:
            state[key] = torch.randn(value.shape, generator=gen) * 0.5
    return state


def has_bn(kind: str) -> bool:
    return kind != "plain"


def eval_shards(n: int) -> list[tuple[int, slice]]:
    """(rank, rows) of each shard of an eval-mode forward: torch.chunk."""
    sizes = [len(c) for c in torch.chunk(torch.empty(n), WORKERS)]
    return _slices(sizes)


def train_shards(n: int) -> list[tuple[int, slice]]:
    """(rank, rows) of each shard of a train-mode forward of a batch-norm model:
    torch.chunk over the most workers that keep every shard at 2 rows or more."""
    for parts in range(WORKERS, 0, -1):
        sizes = [len(c) for c in torch.chunk(torch.empty(n), parts)]
        if parts == 1 or min(sizes) >= 2:
            return _slices(sizes)
    raise AssertionError("unreachable: one part always fits")


def _slices(sizes: list[int]) -> list[tuple[int, slice]]:
    out, start = [], 0
    for rank, size in enumerate(sizes):
        out.append((rank, slice(start, start + size)))
        start += size
    return out


class MaybeZero:
    """A gradient that may be absent or all zeros (reduced when no rank had one)."""

    def __repr__(self) -> str:
        return "MAYBE_ZERO"


MAYBE_ZERO = MaybeZero()


@dataclass
class Masked:
    """A dropout shard's output: Linear2(mask * 2 * hidden) for some 0/1 mask per row."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class RefModel:
    kind: str
    name: str
    replicas: list[nn.Sequential]  # one per rank: weights and buffers
    version: int
    training: bool  # the recorded mode
    batching: collectives.Batching | None
    grads: list[dict[str, Any]] = field(default_factory=list)  # absent key: no gradient
    # Per rank and parameter, how far float32 may stray from ``grads`` where the
    # computation is ill-conditioned: the largest difference between the float32 and a
    # float64 reference of the same train_step over the parameter's elements (batch
    # norm over a 2-row shard whose rows are nearly equal amplifies rounding far beyond
    # TOL; see SLACK_FACTOR). Empty: TOL alone.
    grad_slack: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # Unreduced dp-backward gradients on the workers: "clear", "set", or "maybe"
    # (after a reload dropped them; the contract is silent there).
    whole_batch: str = "clear"

    def __post_init__(self) -> None:
        if not self.grads:
            self.grads = [{} for _ in range(WORKERS)]
        if not self.grad_slack:
            self.grad_slack = [{} for _ in range(WORKERS)]

    def reset_grads(self) -> None:
        """No gradient on any rank (zero_grad, a publish, a reload)."""
        self.grads = [{} for _ in range(WORKERS)]
        self.grad_slack = [{} for _ in range(WORKERS)]


@dataclass
class RefHandle:
    dp: Any
    mode: bool | None = None  # None until its first use


def close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, slack: torch.Tensor | None = None
) -> None:
    """``actual`` equals ``expected`` within TOL, widened element by element by ``slack``
    (the rounding an ill-conditioned reference itself shows; see ``RefModel.grad_slack``)."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {actual!r}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if slack is None:
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")
        return
    allowed = TOL["atol"] + TOL["rtol"] * expected.abs() + SLACK_FACTOR * slack
    off = (actual - expected).abs() > allowed
    assert not bool(off.any()), (
        f"{what}: {int(off.sum())} of {off.numel()} elements beyond TOL and the reference's "
        f"own float32 rounding x{SLACK_FACTOR}: {actual[off].tolist()} != {expected[off].tolist()}"
    )


def float64_gradients(
    replica: nn.Sequential, x: torch.Tensor, y: torch.Tensor, weight: float
) -> dict[str, torch.Tensor]:
    """The parameters' gradients of ``weight * mse(replica(x), y)`` in train mode, computed
    in float64 on a copy (the replica and its running statistics are left alone): how far
    the float32 reference's own rounding goes on these inputs."""
    twin = copy.deepcopy(replica).double().train(True)
    loss = functional.mse_loss(twin(x.double()), y.double()) * weight
    loss.backward()
    return {name: p.grad for name, p in twin.named_parameters() if p.grad is not None}


def check_masked(actual: torch.Tensor, masked: Masked, what: str) -> None:
    """Each row of ``actual`` is the model's output under some dropout mask."""
    hidden_width = masked.hidden.shape[1]
    masks = torch.tensor(
        [[(m >> j) & 1 for j in range(hidden_width)] for m in range(1 << hidden_width)],
        dtype=torch.float32,
    )
    assert actual.shape == (masked.hidden.shape[0], masked.weight.shape[0]), (
        f"{what}: shape {tuple(actual.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{what}: not finite: {actual}"
    for row in range(actual.shape[0]):
        kept = masks * (2.0 * masked.hidden[row])  # (masks, hidden)
        candidates = kept @ masked.weight.T + masked.bias
        err = (candidates - actual[row]).abs() - TOL["rtol"] * actual[row].abs()
        best = err.max(dim=1).values.min()
        assert best <= TOL["atol"], (
            f"{what}: row {row} ({actual[row].tolist()}) is no dropout mask's output "
            f"(nearest off by {float(best):.3g})"
        )


class Unexpected(AssertionError):
    pass


# What the run did (call kind -> outcome -> count), printed at its end.
STATS: Counter[str] = Counter()


def expect(what: str, fn: Callable[[], Any], *allowed: type[BaseException]) -> Any:
    """``fn()``; an error of a type in ``allowed`` is returned, any other fails."""
    kind = what.split("(")[0].split(" ")[0]
    try:
        result = fn()
    except Exception as exc:
        STATS[f"{kind}: {type(exc).__name__}"] += 1
        if allowed and isinstance(exc, allowed):
            return exc
        raise Unexpected(f"{what}: unexpected {type(exc).__name__}: {exc}") from exc
    STATS[f"{kind}: ok"] += 1
    return result


def must_fail(what: str, fn: Callable[[], Any], *errors: type[BaseException]) -> None:
    got = expect(what, fn, *errors)
    assert isinstance(got, errors), f"{what}: expected {[e.__name__ for e in errors]}, got {got!r}"


# --------------------------------------------------------------------------- cluster


@dataclass
class Env:
    address: str
    clients: list[Any]
    run: str  # a prefix no other test uses
    example: int = 0


@pytest.fixture(scope="module")
def model_env(local_cluster: Callable[..., str]) -> Iterator[Env]:
    """CLIENTS connections to one local cluster of WORKERS workers (the conftest's
    launcher, which also checks that no daemon logged INTERNAL), for the module."""
    address = local_cluster(WORKERS)
    clients: list[Any] = []
    try:
        clients.append(connect_ready(address, WORKERS))
        for _ in range(CLIENTS - 1):
            clients.append(collectives.connect(address, timeout=TIMEOUT))
        yield Env(address, clients, f"mc{uuid.uuid4().hex[:8]}")
    finally:
        for client in clients:
            client.close()


# ------------------------------------------------------------------ state machine


class ManyClients(RuleBasedStateMachine):
    env: Env  # set by the test before running

    def __init__(self) -> None:
        super().__init__()
        env = type(self).env
        env.example += 1
        self.clients = env.clients
        self.prefix = f"{env.run}/e{env.example}"
        self.models: dict[str, RefModel] = {}
        self.handles: dict[tuple[int, str, int], RefHandle] = {}
        self.tensors: dict[str, list[torch.Tensor | None]] = {
            tag: [None] * WORKERS for tag in TENSOR_TAGS
        }
        self.templates = TEMPLATES

    # ---------------------------------------------------------------- helpers
    def mname(self, kind: str) -> str:
        return f"{self.prefix}/{kind}"

    def tname(self, tag: str) -> str:
        return f"{self.prefix}/t/{tag}"

    def handle(self, client: int, kind: str, slot: int) -> RefHandle:
        key = (client, kind, slot)
        if key not in self.handles:
            dp = self.clients[client].data_parallel(self.mname(kind), timeout=TIMEOUT)
            assert isinstance(dp, collectives.DataParallel)
            self.handles[key] = RefHandle(dp)
        return self.handles[key]

    def drop_handles(self, kind: str) -> None:
        for key in [k for k in self.handles if k[1] == kind]:
            del self.handles[key]

    def ref_run(
        self, model: RefModel, rank: int, x: torch.Tensor, training: bool
    ) -> torch.Tensor | Masked:
        """Rank ``rank``'s replica on ``x`` in a mode (autograd as the caller set it);
        updates its running statistics in train mode, as torch does."""
        rep = model.replicas[rank]
        hidden = rep[1].train(training)(rep[0](x))
        if training and DROPOUT_P[model.kind] > 0:
            return Masked(hidden.detach(), rep[3].weight.detach(), rep[3].bias.detach())
        return rep[3](hidden)  # dropout: identity in eval mode and at p=0

    def collect_grads(self, model: RefModel, ranks: list[int]) -> None:
        """Adds the replicas' .grad (of ``ranks``) to the reference gradients."""
        for rank in ranks:
            for pname, p in model.replicas[rank].named_parameters():
                if p.grad is None:
                    continue
                have = model.grads[rank].get(pname)
                if isinstance(have, torch.Tensor):
                    model.grads[rank][pname] = have + p.grad
                else:
                    model.grads[rank][pname] = p.grad.clone()
                p.grad = None

    def verify_model(self, kind: str, client: int = 0, *, adopt: bool = False) -> None:
        """Every rank's state dict and gradients against the reference.

        With ``adopt``, the reference then takes the cluster's values (once they are
        found close): an optimizer step feeds each rounding difference back into the
        next gradient, and over dozens of steps with large learning rates float32
        rounding alone grows past any fixed tolerance. Anchoring after each step
        checks every step to rounding, not the trajectory's accumulated chaos."""
        model = self.models[kind]
        cluster = self.clients[client]
        for rank in range(WORKERS):
            state = expect(
                f"state_dict {kind} rank {rank}",
                lambda rank=rank: cluster.state_dict(model.name, rank=rank, timeout=TIMEOUT),
            )
            expected = model.replicas[rank].state_dict()
            assert set(state) == set(expected), f"{kind} rank {rank}: keys {sorted(state)}"
            for key, value in expected.items():
                what = f"{kind} v{model.version} rank {rank} {key}"
                if key.endswith("num_batches_tracked"):
                    assert int(state[key]) == int(value), f"{what}: {int(state[key])} != {value}"
                else:
                    close(state[key], value, what)
            if adopt:
                with torch.no_grad():
                    model.replicas[rank].load_state_dict(state)
            grads = expect(
                f"gradients {kind} rank {rank}",
                lambda rank=rank: cluster.gradients(model.name, rank=rank, timeout=TIMEOUT),
            )
            ref = model.grads[rank]
            must_have = {k for k, v in ref.items() if isinstance(v, torch.Tensor)}
            may_have = must_have | {k for k, v in ref.items() if v is MAYBE_ZERO}
            assert must_have <= set(grads) <= may_have, (
                f"{kind} rank {rank}: gradients of {sorted(grads)}, expected {sorted(must_have)}"
                + (
                    f" (or zeros for {sorted(may_have - must_have)})"
                    if may_have != must_have
                    else ""
                )
            )
            for key, value in grads.items():
                want = ref[key]
                want = torch.zeros_like(value) if want is MAYBE_ZERO else want
                slack = model.grad_slack[rank].get(key)
                close(value, want, f"{kind} rank {rank} grad {key}", slack)
                if adopt and isinstance(ref[key], torch.Tensor):
                    ref[key] = value.clone()

    # ---------------------------------------------------------------- loading
    @initialize(
        client=st.integers(0, CLIENTS - 1),
        modes=st.tuples(*[st.booleans()] * len(KINDS)),
        batching=st.sampled_from((None, (4, 0.0), (64, 2.0))),
        rows=st.tuples(*[ROWS_PER_RANK] * WORKERS).filter(any),
        seed=SEEDS,
    )
    def load_all(
        self,
        client: int,
        modes: tuple[bool, ...],
        batching: tuple[int, float] | None,
        rows: tuple[int, ...],
        seed: int,
    ) -> None:
        for kind, training in zip(KINDS, modes, strict=True):
            self.load_model(client, kind, training, batching, None)
        self.place_train_data(client, rows, seed)

    def load_model(
        self,
        client: int,
        kind: str,
        training: bool,
        batching: tuple[int, float] | None,
        state_seed: int | None,
    ) -> None:
        template = self.templates[kind].train(training)
        policy = None if batching is None else collectives.Batching(*batching)
        state = None
        if state_seed is not None:
            state = random_state(kind, torch.Generator().manual_seed(state_seed))
        name = self.mname(kind)
        info = expect(
            f"load_model {kind}",
            lambda: self.clients[client].load_model(
                name,
                template,
                (torch.randn(4, 6),),
                state_dict=state,
                batching=policy,
                timeout=TIMEOUT,
            ),
        )
        replicas = [copy.deepcopy(template) for _ in range(WORKERS)]
        if state is not None:
            for rep in replicas:
                rep.load_state_dict(state)
        previous = self.models.get(kind)
        self.models[kind] = RefModel(
            kind,
            name,
            replicas,
            version=1 if state is None else 2,
            training=training,
            batching=policy,
            whole_batch="clear" if previous is None else "maybe",
        )
        self.drop_handles(kind)
        assert info.version == self.models[kind].version, f"load_model {kind}: {info}"
        assert info.training is training, f"load_model {kind}: training {info.training}"
        assert info.batching == policy, f"load_model {kind}: batching {info.batching}"

    def unload_model(self, client: int, kind: str, missing_ok: bool) -> None:
        call = lambda: self.clients[client].unload_model(  # noqa: E731
            self.mname(kind), missing_ok=missing_ok, timeout=TIMEOUT
        )
        if kind in self.models or missing_ok:
            expect(f"unload_model {kind}", call)
        else:
            must_fail(f"unload_model {kind} (absent)", call, collectives.NotFound)
        self.models.pop(kind, None)
        self.drop_handles(kind)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        unload=st.sampled_from((False, False, True)),
        training=st.booleans(),
        batching=st.sampled_from((None, (4, 0.0), (64, 2.0))),
        state_seed=st.none() | SEEDS,
    )
    def load_or_unload(
        self,
        client: int,
        kind: str,
        unload: bool,
        training: bool,
        batching: tuple[int, float] | None,
        state_seed: int | None,
    ) -> None:
        """load_model (replacing; module in train or eval mode, batching or not, weights
        published with it or not), or unload_model (missing_ok when drawn with a state)."""
        if unload:
            self.unload_model(client, kind, missing_ok=state_seed is not None)
        else:
            self.load_model(client, kind, training, batching, state_seed)

    # ----------------------------------------------------------------- modes
    def set_model_mode(self, client: int, kind: str, training: bool) -> None:
        call = lambda: self.clients[client].set_model_mode(  # noqa: E731
            self.mname(kind), training, timeout=TIMEOUT
        )
        if kind not in self.models:
            must_fail(f"set_model_mode {kind} (absent)", call, collectives.NotFound)
            return
        info = expect(f"set_model_mode {kind}", call)
        self.models[kind].training = training
        assert info.training is training, f"set_model_mode({training}) answered {info}"
        assert info.version == self.models[kind].version, f"set_model_mode changed {info}"

    def dp_train_or_eval(self, client: int, kind: str, slot: int, training: bool) -> None:
        h = self.handle(client, kind, slot)
        call = (lambda: h.dp.train()) if training else (lambda: h.dp.eval())
        if kind not in self.models:
            must_fail(f"dp.train({training}) {kind} (absent)", call, collectives.NotFound)
            return
        got = expect(f"dp.train({training}) {kind}", call)
        assert got is h.dp
        h.mode = training
        self.models[kind].training = training

    def read_dp_training(self, client: int, kind: str, slot: int) -> None:
        h = self.handle(client, kind, slot)
        if kind not in self.models:
            got = expect(
                f"dp.training {kind} (absent)", lambda: h.dp.training, collectives.NotFound
            )
            if h.mode is None:
                assert isinstance(got, collectives.NotFound), f"dp.training of absent: {got!r}"
            return
        if h.mode is None:
            h.mode = self.models[kind].training  # first use: takes the recorded mode
        got = expect(f"dp.training {kind}", lambda: h.dp.training)
        assert got is h.mode, f"{kind} client {client} slot {slot}: training {got}, own {h.mode}"

    def new_handle(self, client: int, kind: str, slot: int) -> None:
        self.handles.pop((client, kind, slot), None)
        self.handle(client, kind, slot)

    # --------------------------------------------------------------- forwards
    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        slot=st.integers(0, 1),
        rows=st.integers(1, 3 * WORKERS),
        seed=SEEDS,
    )
    def forward_no_grad(self, client: int, kind: str, slot: int, rows: int, seed: int) -> None:
        self.forward(client, kind, slot, rows, False, False, seed)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        slot=st.integers(0, 1),
        rows=st.integers(1, 3 * WORKERS),
        input_grad=st.booleans(),
        seed=SEEDS,
    )
    def forward_backward(
        self, client: int, kind: str, slot: int, rows: int, input_grad: bool, seed: int
    ) -> None:
        self.forward(client, kind, slot, rows, True, input_grad, seed)

    def forward(
        self,
        client: int,
        kind: str,
        slot: int,
        rows: int,
        grad: bool,
        input_grad: bool,
        seed: int,
    ) -> None:
        """dp(x), with autograd a backward of an MSE loss over the gathered output."""
        h = self.handle(client, kind, slot)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, 6, generator=gen)
        y = torch.randn(rows, 3, generator=gen)
        if kind not in self.models:
            with torch.no_grad():
                must_fail(f"dp({kind}) absent", lambda: h.dp(x), collectives.NotFound)
            return
        model = self.models[kind]
        if h.mode is None:
            h.mode = model.training
        training = h.mode
        if training and DROPOUT_P[kind] > 0:
            grad = False  # a random forward: never trained through
        what = f"dp({kind}, {rows} rows, {'train' if training else 'eval'}, grad={grad})"
        if training and rows == 1 and has_bn(kind):
            with torch.set_grad_enabled(grad):
                must_fail(what, lambda: h.dp(x), collectives.InvalidArgument)
            return
        shards = train_shards(rows) if training and has_bn(kind) else eval_shards(rows)
        STATS[f"~ forward {'train' if training else 'eval'} grad={grad} shards={len(shards)}"] += 1
        x_remote = x.clone().requires_grad_(grad and input_grad)
        x_ref = x.clone().requires_grad_(grad and input_grad)
        with torch.set_grad_enabled(grad):
            out = expect(what, lambda: h.dp(x_remote))
            refs = [(rank, rows_, self.ref_run(model, rank, x_ref[rows_], training))
                    for rank, rows_ in shards]  # fmt: skip
        assert h.dp.last_version == model.version, f"{what}: version {h.dp.last_version}"
        assert isinstance(out, torch.Tensor) and out.shape == (rows, 3), f"{what}: {out!r}"
        for rank, rows_, ref in refs:
            part = f"{what} shard rows {rows_.start}:{rows_.stop} on rank {rank}"
            if isinstance(ref, Masked):
                check_masked(out[rows_].detach(), ref, part)
            else:
                close(out[rows_].detach(), ref.detach(), part)
        if not grad:
            return
        loss = functional.mse_loss(out, y)
        expected = functional.mse_loss(torch.cat([r for _, _, r in refs]), y)
        expect(f"{what} backward", loss.backward)
        expected.backward()
        close(loss.detach(), expected.detach(), f"{what} loss")
        self.collect_grads(model, [rank for rank, _, _ in refs])
        model.whole_batch = "set"
        if input_grad:
            close(x_remote.grad, x_ref.grad, f"{what} input gradient")

    @precondition(lambda self: self.models)
    @rule(
        kind=st.sampled_from(KINDS),
        rows=st.tuples(*[st.integers(1, 5)] * CLIENTS),
        seed=SEEDS,
    )
    def concurrent_eval_forwards(self, kind: str, rows: tuple[int, ...], seed: int) -> None:
        """Every client's no-grad forward at once (merged by the batcher when on);
        only handles in eval mode take part (train-mode updates depend on order)."""
        if kind not in self.models:
            return
        model = self.models[kind]
        gen = torch.Generator().manual_seed(seed)
        calls = []
        for client, n in enumerate(rows):
            h = self.handle(client, kind, 0)
            if (model.training if h.mode is None else h.mode) is False:
                h.mode = False  # used now: an unbound handle takes the recorded mode
                calls.append((client, h, torch.randn(n, 6, generator=gen)))
        if not calls:
            return
        results: dict[int, Any] = {}
        start = threading.Barrier(len(calls))

        def run(client: int, h: RefHandle, x: torch.Tensor) -> None:
            start.wait(timeout=TIMEOUT)
            try:
                with torch.no_grad():
                    results[client] = (h.dp(x), h.dp.last_version)
            except Exception as exc:
                results[client] = exc

        threads = [threading.Thread(target=run, args=c) for c in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=2 * TIMEOUT)
        for client, _, x in calls:
            what = f"concurrent eval dp({kind}) client {client}, {x.shape[0]} rows"
            got = results.get(client)
            if isinstance(got, Exception):
                raise Unexpected(f"{what}: {type(got).__name__}: {got}") from got
            assert got is not None, f"{what}: no answer"
            out, version = got
            assert version == model.version, f"{what}: version {version}"
            with torch.no_grad():
                expected = torch.cat(
                    [self.ref_run(model, rank, x[s], False) for rank, s in eval_shards(len(x))]
                )
            close(out, expected, what)

    # -------------------------------------------------------------- gradients
    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        op=st.sampled_from(("sum", "avg")),
    )
    def all_reduce_gradients(self, client: int, kind: str, op: str) -> None:
        what = f"all_reduce_gradients({kind}, {op}) from client {client}"
        call = lambda: self.clients[client].all_reduce_gradients(  # noqa: E731
            self.mname(kind), op=op, timeout=TIMEOUT
        )
        if kind not in self.models:
            must_fail(what, call, collectives.NotFound)
            return
        model = self.models[kind]
        if op == "avg" and model.whole_batch == "set":
            must_fail(what + " over unreduced dp gradients", call, collectives.InvalidArgument)
            return
        allowed = (
            (collectives.InvalidArgument,) if op == "avg" and model.whole_batch == "maybe" else ()
        )
        got = expect(what, call, *allowed)
        if isinstance(got, collectives.InvalidArgument):
            return  # refused; nothing changed
        names = [n for n, _ in model.replicas[0].named_parameters()]
        for pname in names:
            parts = [g.get(pname) for g in model.grads]
            tensors = [p for p in parts if isinstance(p, torch.Tensor)]
            if not tensors:
                reduced: Any = MAYBE_ZERO
            else:
                zeros = torch.zeros_like(tensors[0])
                full = [p if isinstance(p, torch.Tensor) else zeros for p in parts]
                reduced = reduce_oracle(op, full)
            for g in model.grads:
                g[pname] = reduced
            slacks = [sl[pname] for sl in model.grad_slack if pname in sl]
            if slacks:
                combined = sum(slacks) / (len(full) if op == "avg" else 1)
                for sl in model.grad_slack:
                    sl[pname] = combined
        if op == "sum":
            model.whole_batch = "clear"

    @rule(client=st.integers(0, CLIENTS - 1), kind=st.sampled_from(KINDS))
    def zero_grad(self, client: int, kind: str) -> None:
        call = lambda: self.clients[client].zero_grad(self.mname(kind), timeout=TIMEOUT)  # noqa: E731
        if kind not in self.models:
            must_fail(f"zero_grad {kind} (absent)", call, collectives.NotFound)
            return
        expect(f"zero_grad {kind}", call)
        model = self.models[kind]
        model.reset_grads()
        model.whole_batch = "clear"

    @rule(client=st.integers(0, CLIENTS - 1), kind=st.sampled_from(KINDS), lr=LRS)
    def step(self, client: int, kind: str, lr: float) -> None:
        call = lambda: self.clients[client].step(  # noqa: E731
            self.mname(kind), optimizer="sgd", lr=lr, timeout=TIMEOUT
        )
        if kind not in self.models:
            must_fail(f"step {kind} (absent)", call, collectives.NotFound)
            return
        expect(f"step {kind}", call)
        model = self.models[kind]
        with torch.no_grad():
            for rep, grads in zip(model.replicas, model.grads, strict=True):
                for pname, p in rep.named_parameters():
                    g = grads.get(pname)
                    if isinstance(g, torch.Tensor):
                        p.add_(g, alpha=-lr)
        model.version += 1
        self.verify_model(kind, client, adopt=True)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(("det", "plain")),
        optimizer=st.sampled_from((None, "sgd")),
        lr=LRS,
    )
    def train_step(self, client: int, kind: str, optimizer: str | None, lr: float) -> None:
        what = f"train_step({kind}, optimizer={optimizer}) from client {client}"
        hyper = {"lr": lr} if optimizer else {}
        call = lambda: self.clients[client].train_step(  # noqa: E731
            self.mname(kind),
            self.tname("tx"),
            self.tname("ty"),
            loss="mse",
            optimizer=optimizer,
            timeout=TIMEOUT,
            **hyper,
        )
        xs, ys = self.tensors["tx"], self.tensors["ty"]
        if kind not in self.models:
            must_fail(what + " (model absent)", call, collectives.NotFound)
            return
        missing = [r for r in range(WORKERS) if xs[r] is None or ys[r] is None]
        if missing:
            errors = (collectives.FailedPrecondition, collectives.NotFound)
            if all(xs[r] is None for r in range(WORKERS)) and all(
                ys[r] is None for r in range(WORKERS)
            ):
                errors = (collectives.NotFound,)
            must_fail(what + f" (data missing on ranks {missing})", call, *errors)
            return
        sizes = []
        for x, y in zip(xs, ys, strict=True):
            assert x is not None and y is not None
            if not (x.dim() == 2 and x.shape[1] == 6 and y.shape == (x.shape[0], 3)):
                return  # not this test's business: a shape the model refuses
            sizes.append(x.shape[0])
        total = sum(sizes)
        if total == 0:
            return
        if has_bn(kind) and 1 in sizes:  # batch norm refuses a 1-row shard, as torch does
            must_fail(what + f" (shards {sizes})", call, collectives.InvalidArgument)
            # Running statistics and weights as they were (checked by the next verify);
            # the gradients cleared on every rank, as train_step clears them first.
            model = self.models[kind]
            model.reset_grads()
            model.whole_batch = "clear"
            return
        model = self.models[kind]
        got = expect(what, call)
        expected_loss = 0.0
        for rep in model.replicas:
            rep.zero_grad(set_to_none=True)
        summed: dict[str, torch.Tensor] = {}
        slack: dict[str, torch.Tensor] = {}
        for rank, n in enumerate(sizes):
            if n == 0:
                continue  # no forward there, zero gradient
            assert xs[rank] is not None and ys[rank] is not None
            twin = float64_gradients(model.replicas[rank], xs[rank], ys[rank], n / total)
            out = self.ref_run(model, rank, xs[rank], True)
            assert isinstance(out, torch.Tensor)
            part = functional.mse_loss(out, ys[rank]) * (n / total)
            part.backward()
            expected_loss += float(part.detach())
            for pname, p in model.replicas[rank].named_parameters():
                if p.grad is not None:
                    summed[pname] = summed.get(pname, 0) + p.grad
                    off = (p.grad.double() - twin[pname]).abs().max().float()
                    slack[pname] = slack.get(pname, 0) + torch.full_like(p.grad, float(off))
                p.grad = None
        assert got == pytest.approx(expected_loss, rel=TOL["rtol"], abs=TOL["atol"]), (
            f"{what}: loss {got}, expected {expected_loss} (shards {sizes})"
        )
        model.grads = [dict(summed) for _ in range(WORKERS)]
        model.grad_slack = [dict(slack) for _ in range(WORKERS)]
        model.whole_batch = "clear"
        if optimizer:
            with torch.no_grad():
                for rep in model.replicas:
                    for pname, p in rep.named_parameters():
                        if pname in summed:
                            p.add_(summed[pname], alpha=-lr)
            model.version += 1
            self.verify_model(kind, client, adopt=True)

    # --------------------------------------------------------------- publish
    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        source=st.none() | st.integers(0, WORKERS - 1),
        seed=SEEDS,
        as_load_state_dict=st.booleans(),
    )
    def publish(
        self, client: int, kind: str, source: int | None, seed: int, as_load_state_dict: bool
    ) -> None:
        """New weights: fresh random ones, or one rank's (running stats included)."""
        cluster = self.clients[client]
        name = self.mname(kind)
        if kind not in self.models:
            state = random_state(kind, torch.Generator().manual_seed(seed))
            must_fail(
                f"publish {kind} (absent)",
                lambda: cluster.publish(name, state, timeout=TIMEOUT),
                collectives.NotFound,
            )
            return
        model = self.models[kind]
        if source is None:
            state = random_state(kind, torch.Generator().manual_seed(seed))
        else:
            state = expect(
                f"state_dict {kind} rank {source}",
                lambda: cluster.state_dict(name, rank=source, timeout=TIMEOUT),
            )
            reference = model.replicas[source].state_dict()
            for key, value in reference.items():
                if not key.endswith("num_batches_tracked"):
                    close(state[key], value, f"{kind} rank {source} {key} before publish")
            state = {k: v.clone() for k, v in reference.items()}  # the reference's exact values
        if as_load_state_dict:
            version = expect(
                f"load_state_dict {kind}",
                lambda: cluster.load_state_dict(name, state, timeout=TIMEOUT),
            )
        else:
            version = expect(
                f"publish {kind}", lambda: cluster.publish(name, state, timeout=TIMEOUT)
            )
        for rep in model.replicas:
            rep.load_state_dict(state)  # in place: each replica keeps its .grad
        model.version += 1
        assert version == model.version, f"publish {kind}: version {version}"

    # ---------------------------------------------------------- named tensors
    def put(
        self, client: int, tag: str, rank: int | None, shape: tuple[int, ...], seed: int
    ) -> None:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        expect(
            f"put {tag} rank {rank}",
            lambda: self.clients[client].put(self.tname(tag), t, rank=rank, timeout=TIMEOUT),
        )
        for r in range(WORKERS) if rank is None else [rank]:
            self.tensors[tag][r] = t.clone()

    @rule(
        client=st.integers(0, CLIENTS - 1),
        rows=st.tuples(*[ROWS_PER_RANK] * WORKERS) | st.integers(0, 4 * WORKERS),
        seed=SEEDS,
    )
    def place_train_data(self, client: int, rows: tuple[int, ...] | int, seed: int) -> None:
        """Inputs ``tx`` and targets ``ty``: per-rank puts of chosen sizes, or a scatter."""
        gen = torch.Generator().manual_seed(seed)
        cluster = self.clients[client]
        if isinstance(rows, int):
            x, y = torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)
            for tag, t in (("tx", x), ("ty", y)):
                expect(
                    f"scatter {tag} ({rows} rows)",
                    lambda tag=tag, t=t: cluster.scatter(self.tname(tag), t, timeout=TIMEOUT),
                )
                self.tensors[tag] = [p.clone() for p in torch.tensor_split(t, WORKERS)]
            return
        for rank, n in enumerate(rows):
            x, y = torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)
            for tag, t in (("tx", x), ("ty", y)):
                expect(
                    f"put {tag} rank {rank}",
                    lambda tag=tag, t=t, rank=rank: cluster.put(
                        self.tname(tag), t, rank=rank, timeout=TIMEOUT
                    ),
                )
                self.tensors[tag][rank] = t

    def get(self, client: int, tag: str, rank: int) -> None:
        call = lambda: self.clients[client].get(self.tname(tag), rank=rank, timeout=TIMEOUT)  # noqa: E731
        want = self.tensors[tag][rank]
        if want is None:
            must_fail(f"get {tag} rank {rank} (absent)", call, collectives.NotFound)
            return
        close(expect(f"get {tag} rank {rank}", call), want, f"get {tag} rank {rank}")

    def delete(self, client: int, tag: str, rank: int | None) -> None:
        call = lambda: self.clients[client].delete(self.tname(tag), rank=rank, timeout=TIMEOUT)  # noqa: E731
        where = range(WORKERS) if rank is None else [rank]
        if all(self.tensors[tag][r] is None for r in where):
            must_fail(f"delete {tag} rank {rank} (absent)", call, collectives.NotFound)
            return
        expect(f"delete {tag} rank {rank}", call)
        for r in where:
            self.tensors[tag][r] = None

    def operand_error(self, tag: str, needed: list[int]) -> tuple[type[BaseException], ...]:
        """The errors a collective on ``tag`` must give, () when it must succeed."""
        parts = self.tensors[tag]
        if all(p is None for p in parts):
            return (collectives.NotFound,)
        if any(parts[r] is None for r in needed):
            return (collectives.FailedPrecondition,)
        present = [parts[r] for r in needed]
        if len({(p.dtype, tuple(p.shape)) for p in present if p is not None}) > 1:
            return (collectives.FailedPrecondition,)
        return ()

    def all_reduce(self, client: int, tag: str, op: str) -> None:
        what = f"all_reduce({tag}, {op})"
        call = lambda: self.clients[client].all_reduce(self.tname(tag), op=op, timeout=TIMEOUT)  # noqa: E731
        errors = self.operand_error(tag, list(range(WORKERS)))
        if errors:
            must_fail(what, call, *errors)
            return
        assert expect(what, call) is None
        parts = self.tensors[tag]
        reduced = reduce_oracle(op, [p for p in parts if p is not None])
        self.tensors[tag] = [reduced.clone() for _ in range(WORKERS)]

    def broadcast(self, client: int, tag: str, src: int) -> None:
        what = f"broadcast({tag}, src={src})"
        call = lambda: self.clients[client].broadcast(self.tname(tag), src=src, timeout=TIMEOUT)  # noqa: E731
        errors = self.operand_error(tag, [src])
        if errors:
            must_fail(what, call, *errors)
            return
        assert expect(what, call) is None
        value = self.tensors[tag][src]
        assert value is not None
        self.tensors[tag] = [value.clone() for _ in range(WORKERS)]

    def all_gather(self, client: int, tag: str, out: str | None) -> None:
        what = f"all_gather({tag}, out={out})"
        call = lambda: self.clients[client].all_gather(  # noqa: E731
            self.tname(tag), out=None if out is None else self.tname(out), timeout=TIMEOUT
        )
        errors = self.operand_error(tag, list(range(WORKERS)))
        if errors:
            must_fail(what, call, *errors)
            return
        got = expect(what, call)
        parts = [p for p in self.tensors[tag] if p is not None]
        assert isinstance(got, list) and len(got) == WORKERS, f"{what}: {got!r}"
        for rank, (g, p) in enumerate(zip(got, parts, strict=True)):
            close(g, p, f"{what} part {rank}")
        stacked = torch.stack(parts)
        self.tensors[out or tag] = [stacked.clone() for _ in range(WORKERS)]

    # ------------------------------------------------ combined rules (weights)
    # Each rule below stands for several calls, so that forwards and training
    # (the point of this test) are drawn as often as the data plumbing.
    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        via_handle=st.none() | st.integers(0, 1),
        training=st.booleans(),
    )
    def switch_mode(self, client: int, kind: str, via_handle: int | None, training: bool) -> None:
        """``cluster.set_model_mode`` (via_handle None) or ``dp.train()``/``dp.eval()``."""
        if via_handle is None:
            self.set_model_mode(client, kind, training)
        else:
            self.dp_train_or_eval(client, kind, via_handle, training)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        kind=st.sampled_from(KINDS),
        slot=st.integers(0, 1),
        fresh=st.booleans(),
    )
    def handle_op(self, client: int, kind: str, slot: int, fresh: bool) -> None:
        """A fresh (unbound) handle in the slot, or a read of the slot's ``dp.training``."""
        if fresh:
            self.new_handle(client, kind, slot)
        else:
            self.read_dp_training(client, kind, slot)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        action=st.sampled_from(("put", "get", "delete")),
        tag=st.sampled_from(TENSOR_TAGS),
        rank=st.none() | st.integers(0, WORKERS - 1),
        shape=st.sampled_from(SHAPES),
        seed=SEEDS,
    )
    def tensor_data(
        self,
        client: int,
        action: str,
        tag: str,
        rank: int | None,
        shape: tuple[int, ...],
        seed: int,
    ) -> None:
        """put (one rank or replicated; tx/ty are placed by place_train_data), get, delete."""
        if action == "put" and tag not in ("tx", "ty"):
            self.put(client, tag, rank, shape, seed)
        elif action == "get":
            self.get(client, tag, rank or 0)
        elif action == "delete":
            self.delete(client, tag, rank)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        action=st.sampled_from(("all_reduce", "broadcast", "all_gather")),
        tag=st.sampled_from(TENSOR_TAGS),
        op=st.sampled_from(("sum", "avg", "max")),
        src=st.integers(0, WORKERS - 1),
        out=st.booleans(),
    )
    def collective(self, client: int, action: str, tag: str, op: str, src: int, out: bool) -> None:
        """all_reduce (sum/avg/max), broadcast from src, all_gather (into "g" with out)."""
        if action == "all_reduce":
            self.all_reduce(client, tag, op)
        elif action == "broadcast":
            self.broadcast(client, tag, src)
        elif tag not in ("g", "tx", "ty"):
            self.all_gather(client, tag, "g" if out else None)

    # ----------------------------------------------------------------- checks
    @precondition(lambda self: self.models)
    @rule(client=st.integers(0, CLIENTS - 1), kind=st.sampled_from(KINDS))
    def check_model(self, client: int, kind: str) -> None:
        if kind in self.models:
            self.verify_model(kind, client)

    @invariant()
    def models_listed(self) -> None:
        """Version, recorded mode and batching of every model, as any client sees them."""
        infos = {m.name: m for m in self.clients[0].models(timeout=TIMEOUT)}
        for kind in KINDS:
            name = self.mname(kind)
            if kind not in self.models:
                assert name not in infos, f"{kind} is listed after its unload: {infos[name]}"
                continue
            model = self.models[kind]
            info = infos.get(name)
            assert info is not None, f"{kind} is not listed by models()"
            assert info.version == model.version, (
                f"{kind}: version {info.version}, expected {model.version}"
            )
            assert info.training is model.training, (
                f"{kind}: recorded mode training={info.training}, expected {model.training}"
            )
            assert info.batching == model.batching, f"{kind}: batching {info.batching}"

    @rule()
    def barrier(self) -> None:
        """The first rule hypothesis tries (no arguments): cheap, so its all-zeros first
        example costs little."""
        assert expect("barrier", lambda: self.clients[0].barrier(timeout=TIMEOUT)) is None

    def teardown(self) -> None:
        if sys.exc_info()[0] is None:  # not while a failure propagates
            for kind in self.models:
                self.verify_model(kind)
        cluster = self.clients[0]
        for kind in KINDS:
            cluster.unload_model(self.mname(kind), missing_ok=True, timeout=TIMEOUT)
        for tag in TENSOR_TAGS:
            cluster.delete(self.tname(tag), missing_ok=True, timeout=TIMEOUT)


TEMPLATES = {kind: build(kind) for kind in KINDS}


def _hypothesis_seed(seed: int) -> int:
    forced = os.environ.get("COLLECTIVES_MODEL_TEST_SEED")
    return int(forced) if forced else seed


@pytest.mark.timeout(int(os.environ.get("COLLECTIVES_MODEL_TEST_TIMEOUT_S", "600")))
def test_many_clients_against_the_reference(model_env: Env, seed: int) -> None:
    chosen = _hypothesis_seed(seed)
    print(
        f"many-clients model test: hypothesis seed {chosen} "
        f"(replay: COLLECTIVES_MODEL_TEST_SEED={chosen}), {EXAMPLES} examples x {STEPS} steps, "
        f"{WORKERS} workers, {CLIENTS} clients"
    )
    machine = type("ManyClientsRun", (ManyClients,), {"env": model_env})
    machine = hypothesis_seed(chosen)(machine)
    blob = os.environ.get("COLLECTIVES_MODEL_TEST_REPRODUCE")  # the blob hypothesis printed
    if blob:
        machine = reproduce_failure(hypothesis.__version__, blob.encode())(machine)
    phases = tuple(Phase) if SHRINK else (Phase.explicit, Phase.generate)
    STATS.clear()
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                deadline=None,
                database=None,
                phases=phases,
                print_blob=True,
                verbosity=Verbosity.debug if VERBOSE else Verbosity.normal,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        print("calls made:\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(STATS.items())))


# ------------------------------------------------------------ regression tests
# Each failure the state machine found, as a plain test named for the defect.


def _load(env: Env, kind: str, training: bool, client: int = 0) -> tuple[str, nn.Sequential]:
    """Loads a fresh ``kind`` model (module in train or eval mode) under a new name;
    returns the name and a local copy of the module."""
    module = build(kind).train(training)
    name = f"{env.run}/reg/{kind}/{uuid.uuid4().hex[:6]}"
    env.clients[client].load_model(name, module, (torch.randn(4, 6),), timeout=TIMEOUT)
    return name, module


def _bn_state(env: Env, name: str) -> list[dict[str, torch.Tensor]]:
    return [
        {
            k: v
            for k, v in env.clients[0].state_dict(name, rank=r, timeout=TIMEOUT).items()
            if k.startswith("1.")
        }
        for r in range(WORKERS)
    ]


@pytest.mark.skipif(WORKERS != 3, reason="the shard sizes below are for 3 workers")
def test_train_mode_forward_of_batch_norm_never_cuts_a_one_row_shard(model_env: Env) -> None:
    """Defect 5: in train mode 7 rows on 3 workers are not cut 3, 3, 1 (batch norm on
    one row): torch.chunk over 2 workers, 4 and 3 rows, each rank's batch norm
    normalising and counting its own shard."""
    name, module = _load(model_env, "det", training=True)
    try:
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(5))
        dp = model_env.clients[0].data_parallel(name, timeout=TIMEOUT)
        with torch.no_grad():
            out = dp(x)
        replicas = [copy.deepcopy(module) for _ in range(WORKERS)]
        with torch.no_grad():
            expected = torch.cat(
                [rep(part) for rep, part in zip(replicas, x.chunk(2), strict=False)]
            )
        close(out, expected, "7 rows in train mode")
        for rank, state in enumerate(_bn_state(model_env, name)):
            close(state["1.running_mean"], replicas[rank][1].running_mean, f"rank {rank} mean")
    finally:
        model_env.clients[0].unload_model(name, missing_ok=True, timeout=TIMEOUT)


def test_train_mode_forward_without_batch_norm_splits_as_data_parallel(
    model_env: Env,
) -> None:
    """Without batch norm, train mode splits as nn.DataParallel does (torch.chunk over
    every worker, 3 rows: one each), and each rank gets its shard's gradient."""
    name, module = _load(model_env, "plain", training=True)
    try:
        gen = torch.Generator().manual_seed(6)
        x, y = torch.randn(3, 6, generator=gen), torch.randn(3, 3, generator=gen)
        cluster = model_env.clients[0]
        functional.mse_loss(cluster.data_parallel(name, timeout=TIMEOUT)(x), y).backward()
        functional.mse_loss(module(x), y).backward()
        grads = [cluster.gradients(name, rank=r, timeout=TIMEOUT) for r in range(WORKERS)]
        assert all(g for g in grads), f"a rank got no gradient: {grads}"
        for key, p in module.named_parameters():
            assert p.grad is not None
            total = sum(g[key] for g in grads)
            close(total, p.grad, f"summed grad {key}")
    finally:
        model_env.clients[0].unload_model(name, missing_ok=True, timeout=TIMEOUT)


def test_batch_norm_counts_train_batches_of_a_model_loaded_in_eval_mode(model_env: Env) -> None:
    """A model exported in eval mode and run in train mode (dp.train(), train_step)
    updated its running mean and variance but left num_batches_tracked at 0."""
    name, _ = _load(model_env, "det", training=False)
    cluster = model_env.clients[0]
    xs, ys = f"{name}/x", f"{name}/y"
    try:
        with torch.no_grad():
            cluster.data_parallel(name, timeout=TIMEOUT).train()(torch.randn(6, 6))
        counts = [int(s["1.num_batches_tracked"]) for s in _bn_state(model_env, name)]
        assert counts == [1] * WORKERS, f"after one train-mode forward: {counts}"
        cluster.put(xs, torch.randn(4, 6), timeout=TIMEOUT)
        cluster.put(ys, torch.randn(4, 3), timeout=TIMEOUT)
        cluster.train_step(name, xs, ys, timeout=TIMEOUT)
        counts = [int(s["1.num_batches_tracked"]) for s in _bn_state(model_env, name)]
        assert counts == [2] * WORKERS, f"after a train_step too: {counts}"
    finally:
        cluster.unload_model(name, missing_ok=True, timeout=TIMEOUT)
        for n in (xs, ys):
            cluster.delete(n, missing_ok=True, timeout=TIMEOUT)


def test_train_step_on_inputs_absent_everywhere_is_not_found(model_env: Env) -> None:
    """An absent name is NotFound (train_step answered FailedPrecondition, meant for a
    tensor missing on some ranks only)."""
    name, _ = _load(model_env, "plain", training=True)
    cluster = model_env.clients[1]
    try:
        with pytest.raises(collectives.NotFound):
            cluster.train_step(name, f"{name}/nowhere", f"{name}/nowhere/y", timeout=TIMEOUT)
    finally:
        cluster.unload_model(name, missing_ok=True, timeout=TIMEOUT)


def test_train_step_on_inputs_missing_on_some_ranks_names_them(model_env: Env) -> None:
    """The FailedPrecondition of a train_step whose inputs miss on some ranks carries
    those ranks in ``ranks`` (its message named them, its ``ranks`` was empty)."""
    name, _ = _load(model_env, "plain", training=True)
    cluster = model_env.clients[2]
    xs, ys = f"{name}/x", f"{name}/y"
    try:
        for rank in range(WORKERS - 1):
            cluster.put(xs, torch.randn(2, 6), rank=rank, timeout=TIMEOUT)
        cluster.put(ys, torch.randn(2, 3), timeout=TIMEOUT)
        with pytest.raises(collectives.FailedPrecondition) as caught:
            cluster.train_step(name, xs, ys, timeout=TIMEOUT)
        assert caught.value.ranks == (WORKERS - 1,), caught.value
    finally:
        cluster.unload_model(name, missing_ok=True, timeout=TIMEOUT)
        for n in (xs, ys):
            cluster.delete(n, missing_ok=True, timeout=TIMEOUT)


def test_a_used_handle_keeps_its_mode_when_another_client_switches(model_env: Env) -> None:
    """Defect 3: client 0's handle, used in eval mode, kept running in whatever mode
    another client set last (here train: batch stats, running stats moved)."""
    name, module = _load(model_env, "det", training=False)
    c0, c1, c2 = model_env.clients
    try:
        dp = c0.data_parallel(name, timeout=TIMEOUT)
        x = torch.randn(6, 6, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            dp(x)  # first use: takes the recorded mode, eval
            c1.set_model_mode(name, True, timeout=TIMEOUT)
            out = dp(x)
            expected = module.eval()(x)
        close(out, expected, "eval handle after another client's train mode")
        assert dp.training is False
        for rank, state in enumerate(_bn_state(model_env, name)):
            close(state["1.running_mean"], module[1].running_mean, f"rank {rank} mean")
        assert [m.training for m in c2.models(timeout=TIMEOUT) if m.name == name] == [True]
        assert c2.data_parallel(name, timeout=TIMEOUT).training is True  # a new one: train
    finally:
        c0.unload_model(name, missing_ok=True, timeout=TIMEOUT)


@pytest.mark.skipif(WORKERS != 3, reason="the shards below are for 3 workers")
def test_train_step_is_a_train_mode_full_batch_step(model_env: Env) -> None:
    """Defects 2 and 4: with the recorded mode eval, shards of 4, 2 and 0 rows,
    train_step ran in eval mode, averaged per-rank mean losses (NaN from the empty
    shard), and is to be the full batch's train-mode step, leaving the mode as it was."""
    name, module = _load(model_env, "det", training=False)
    cluster = model_env.clients[1]
    xs, ys = f"{name}/x", f"{name}/y"
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(6, 6, generator=gen), torch.randn(6, 3, generator=gen)
    try:
        for rank, rows in enumerate((slice(0, 4), slice(4, 6), slice(6, 6))):
            cluster.put(xs, x[rows], rank=rank, timeout=TIMEOUT)
            cluster.put(ys, y[rows], rank=rank, timeout=TIMEOUT)
        loss = cluster.train_step(name, xs, ys, optimizer="sgd", lr=0.1, timeout=TIMEOUT)
        replicas = [copy.deepcopy(module).train() for _ in range(2)]
        parts = [
            functional.mse_loss(rep(x[rows]), y[rows]) * (len(x[rows]) / 6)
            for rep, rows in zip(replicas, (slice(0, 4), slice(4, 6)), strict=True)
        ]
        expected = sum(parts)
        expected.backward()
        assert loss == pytest.approx(float(expected), rel=1e-5), (loss, float(expected))
        with torch.no_grad():
            for key, p in module.named_parameters():
                p -= 0.1 * sum(dict(r.named_parameters())[key].grad for r in replicas)
        states = [cluster.state_dict(name, rank=r, timeout=TIMEOUT) for r in range(WORKERS)]
        for rank, state in enumerate(states):
            for key, p in module.named_parameters():
                close(state[key], p.detach(), f"rank {rank} {key}")
        for rank, rep in enumerate(replicas):
            close(states[rank]["1.running_mean"], rep[1].running_mean, f"rank {rank} mean")
        close(states[2]["1.running_mean"], module[1].running_mean, "rank 2 (no rows) mean")
        info = [m for m in cluster.models(timeout=TIMEOUT) if m.name == name]
        assert [(m.training, m.version) for m in info] == [(False, 2)], info
    finally:
        cluster.unload_model(name, missing_ok=True, timeout=TIMEOUT)
        for n in (xs, ys):
            cluster.delete(n, missing_ok=True, timeout=TIMEOUT)


def test_the_avg_refusal_is_the_same_for_every_client(model_env: Env) -> None:
    """Defect 7: after client 0's dp backward, client 1 could all-reduce the gradients
    with "avg"; and after client 1's zero_grad, client 0 still refused "avg"."""
    name, _ = _load(model_env, "plain", training=False)
    c0, c1, c2 = model_env.clients
    try:
        x, y = torch.randn(6, 6), torch.randn(6, 3)
        functional.mse_loss(c0.data_parallel(name, timeout=TIMEOUT)(x), y).backward()
        for other in (c1, c2):
            with pytest.raises(collectives.InvalidArgument):
                other.all_reduce_gradients(name, op="avg", timeout=TIMEOUT)
        c1.zero_grad(name, timeout=TIMEOUT)
        c0.all_reduce_gradients(name, op="avg", timeout=TIMEOUT)
        functional.mse_loss(c2.data_parallel(name, timeout=TIMEOUT)(x), y).backward()
        c1.all_reduce_gradients(name, op="sum", timeout=TIMEOUT)
        c2.all_reduce_gradients(name, op="avg", timeout=TIMEOUT)  # reduced: avg keeps it
    finally:
        c0.unload_model(name, missing_ok=True, timeout=TIMEOUT)
