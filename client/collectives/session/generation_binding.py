"""Which failed collectives the SDK retries: never-started ones, and only while the
generation they were issued for is still current, or the generations since were
carried over by drains (:class:`GenerationBinding`)."""

from __future__ import annotations

from collectives.errors import CollectiveError, Reason, Unavailable
from collectives.wire.cluster_state import ClusterSnapshot

__all__ = ["GenerationBinding", "is_not_executed"]


class GenerationBinding:
    """Binds one collective to the generation it was first sent in.

    A collective names per-rank operands that the caller placed on the ranks of
    one membership. If that generation ends before the op commits, "never
    started" does not make a retry safe: on the new generation the same call
    would reduce over other contributors, a different answer that looks right.
    So a never-started op is retried only while the generation is unchanged
    (leader busy, a transient transport error), or across generations that a
    drain sealed and whose handoff completed (every rank then holds what the same
    rank held: the operands are where they were placed, so the call means the
    same); across any other change the error is surfaced, naming both generations.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.generation: int | None = None
        self._moved = False
        self._last: CollectiveError | None = None
        # Generations this op moved across because drains carried every rank over.
        self.reissued = 0
        self._first: int | None = None

    def bind(self, generation: int, snapshot: ClusterSnapshot | None = None) -> None:
        """Called by every attempt with the generation it is about to send for (and the
        view it comes from, which says whether drains carried the ranks over).

        Raises:
            Unavailable: an earlier attempt was sent for another generation, not
                carried over (or, not marked moved, a drain's handoff has not ended).
        """
        if self.generation is None:
            self.generation = self._first = generation
            return
        if generation == self.generation:
            return
        carried = snapshot.carried_over_since(self.generation) if snapshot is not None else False
        if carried is None:
            raise Unavailable(
                f"{self.what} was issued for generation {self.generation}; a drain into "
                f"generation {generation} is handing a rank over: waiting for it",
                executed=False,
                generation=self.generation,
                reason=Reason.GENERATION_CHANGED,
            )
        if carried:
            self.generation = generation
            self.reissued += 1
            return
        self._moved = True
        cause = f" (the leader said: {self._last.message})" if self._last is not None else ""
        raise Unavailable(
            f"{self.what} was issued for generation {self.generation} and did not run there"
            f"{cause}; the cluster is now at generation {generation}. Nothing was committed. "
            f"It is not retried on the new membership: its operands were placed on the ranks "
            f"of generation {self.generation}; place them again and reissue it",
            executed=False,
            generation=self.generation,
            reason=Reason.GENERATION_CHANGED,
        )

    @property
    def reissued_from(self) -> int:
        """The generation the op was first sent for, once a drain made it move (else 0)."""
        return (self._first or 0) if self.reissued else 0

    def retryable(self, err: CollectiveError) -> bool:
        """The retry predicate: never-started ops, while the generation has not moved."""
        if err.generation is None:
            err.generation = self.generation
        self._last = err
        return not self._moved and is_not_executed(err)


def is_not_executed(err: CollectiveError) -> bool:
    """Collectives are retried only when the server says they never started and a retry
    can succeed: ``UNAVAILABLE`` (not the leader, a transient transport error) or the
    leader's queue being full (it drains); always within the call's deadline.

    Other codes marked not executed (operands missing) would fail the same way
    again, so they are the caller's to handle.
    """
    if err.executed is not False:
        return False
    return isinstance(err, Unavailable) or err.reason == Reason.QUEUE_FULL
