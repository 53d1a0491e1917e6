"""One handler per op kind: ``(ctx, desc, announcement) -> result | CollectiveError``.

The generation loop (``engine.generation``) only sequences and dispatches; what an op
does on a rank is its handler's business:

* every collective on a named tensor, and barrier: ``tensor_ops.run_tensor_op``
  (with its per-kind arithmetic in ``tensor_kinds``);
* ``new_group``: ``group_ops.run_new_group``;
* ``exchange`` (send, batch_isend_irecv): ``exchange_ops.run_exchange``;
* ``destroy_group``: ``group_ops.run_destroy_group``;
* ``all_reduce_gradients`` and ``train_step``: ``model_ops.run_model_op``;
* coalesced all_reduce, broadcast, all_gather: ``coalesced_ops.run_coalesced``
  (its buckets in ``coalesced_buckets``);
* ``publish`` (a new model version): ``publish_ops.run_publish``;
* ``replicate`` (``put`` on every rank, sent once): ``replicate_ops.run_replicate``.

Every handler returns the same outcome on every rank and commits only once
that outcome is known to be shared: it ends with
``OpContext.agree_and_commit`` (the agreement, then the store's commit), or,
for an inline op whose result is a pure function of the exchanged data, with
``OpContext.commit``. A handler raises ``GroupBroken`` only when the process
group itself failed.

Modules:

* ``coalesced_buckets``: the data of a coalesced op: its operands packed into buckets, one
  collective each
* ``coalesced_ops``: the handler of coalesced all_reduce, broadcast and all_gather: several named
  tensors in one atomic op
* ``exchange_ops``: the handler of ``exchange``: ``send`` (one pair) and ``batch_isend_irecv``
  (several)
* ``fused_ops``: several tensor ops announced together (``fusion``): one exchange, then each op
  alone
* ``group_ops``: the handlers of ``new_group`` and ``destroy_group``: every rank takes part
* ``model_ops``: cluster-wide model ops the leader sequences: gradient aggregation and train steps
* ``publish_ops``: the handler of ``publish``: a new model version, sent once, committed everywhere
  or nowhere
* ``replicate_ops``: the handler of ``replicate``: ``put(name, t)`` on every rank, each byte sent
  once
* ``tensor_kinds``: per kind of tensor collective: how a member computes its result
* ``tensor_ops``: the handler of every collective on a named tensor (and of barrier)
* ``uneven_ops``: the handler of an uneven all_to_all (``all_to_all`` with ``split_sizes``)
"""

from __future__ import annotations

from collections.abc import Callable

from collectives.errors import CollectiveError
from collectives.v1 import worker_pb2
from collectives.wire.op_specs import SPECS, OpKind
from collectives_server.worker.engine.handlers.coalesced_ops import run_coalesced
from collectives_server.worker.engine.handlers.exchange_ops import run_exchange
from collectives_server.worker.engine.handlers.group_ops import run_destroy_group, run_new_group
from collectives_server.worker.engine.handlers.model_ops import ModelOpResult, run_model_op
from collectives_server.worker.engine.handlers.publish_ops import PublishResult, run_publish
from collectives_server.worker.engine.handlers.replicate_ops import run_replicate
from collectives_server.worker.engine.handlers.tensor_ops import run_tensor_op
from collectives_server.worker.engine.handlers.uneven_ops import run_uneven_all_to_all
from collectives_server.worker.engine.op_context import Announcement, OpContext, OpResult

__all__ = ["Handler", "HANDLERS", "handler_for"]

Handler = Callable[
    [OpContext, worker_pb2.OpDescriptor, Announcement],
    OpResult | ModelOpResult | PublishResult | CollectiveError,
]

HANDLERS: dict[OpKind, Handler] = {
    **{kind: run_tensor_op for kind, s in SPECS.items() if s.is_collective},
    OpKind.NEW_GROUP: run_new_group,
    OpKind.ALL_REDUCE_GRADIENTS: run_model_op,
    OpKind.TRAIN_STEP: run_model_op,
    OpKind.STEP: run_model_op,
    OpKind.ZERO_GRAD: run_model_op,
    # all_to_all with split_sizes (uneven_ops)
    OpKind.ALL_TO_ALL_UNEVEN: run_uneven_all_to_all,
    # point to point and group teardown
    OpKind.EXCHANGE: run_exchange,
    OpKind.DESTROY_GROUP: run_destroy_group,
    # coalesced all_reduce, broadcast, all_gather
    OpKind.ALL_REDUCE_COALESCED: run_coalesced,
    OpKind.BROADCAST_COALESCED: run_coalesced,
    OpKind.ALL_GATHER_COALESCED: run_coalesced,
    OpKind.PUBLISH_MODEL: run_publish,
    OpKind.REPLICATE: run_replicate,
}


def handler_for(kind: int) -> Handler:
    """The handler of a sequenced op kind; ValueError for noop/stop or an unknown kind."""
    try:
        return HANDLERS[OpKind(kind)]
    except (KeyError, ValueError):
        raise ValueError(f"no handler for op kind {kind}") from None
