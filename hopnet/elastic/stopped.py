"""Why an elastic worker's step failed: when its membership stopped it (cut off from a majority
of its view, dropped, too few members), the membership's one line says so, not the segment's
failure that came first (:meth:`hopnet.elastic.run.ElasticRun.verdict`)."""

from __future__ import annotations

from hopnet.elastic.changeover import Changeover
from hopnet.errors import HopnetError


def raise_if_stopped(changeover: Changeover | None, failure: Exception) -> None:
    """Raise the :class:`~hopnet.errors.MembershipStopped` that explains ``failure`` (a step's),
    and make it the worker's failure, or :class:`~hopnet.elastic.changeover.Left` in a worker whose
    leave was committed; return if the membership did neither."""
    if changeover is None:
        return
    changeover.step_failed(failure)  # a leaver whose run stopped around it leaves all the same
    if not isinstance(failure, HopnetError):
        return
    worker = changeover.worker
    position, members = getattr(failure, "peer", None), worker.node.members
    blamed = position if members is None or position is None else (
        members[position] if 0 <= position < len(members) else None)  # a segment names a peer by its position
    explained: Exception = worker._thread.run(changeover.run.verdict(failure, blamed), timeout_s=None)
    if explained is not failure:
        worker.failure = explained
        raise explained from None  # its line says it all


__all__ = ["raise_if_stopped"]
