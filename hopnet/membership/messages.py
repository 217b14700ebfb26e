"""The membership messages: small frozen dataclasses, each tagged with its sender's view.

``view`` is the number of the view the sender was in when it sent the message. The
consensus messages (:class:`Prepare` to :class:`Commit`) decide view ``view + 1``; their
voters are the members of view ``view``."""

from __future__ import annotations

from dataclasses import dataclass

from hopnet.membership.view import Ballot, Change


@dataclass(frozen=True)
class Requests:
    """Changes asked for and not yet in a view: ranks to admit, ranks leaving, ranks taken for dead."""

    joins: tuple[int, ...] = ()
    leaves: tuple[int, ...] = ()
    deaths: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.joins or self.leaves or self.deaths)


@dataclass(frozen=True)
class Beat:
    """A sign of life; it also tells a member that lags behind to catch up."""

    view: int


@dataclass(frozen=True)
class JoinRequest:
    """Rank ``rank`` asks to be admitted (sent by the joiner, ``view`` is ``NO_VIEW``)."""

    view: int
    rank: int


@dataclass(frozen=True)
class ChangeRequest:
    """Changes the sender knows of, forwarded to the member it expects to propose."""

    view: int
    requests: Requests


@dataclass(frozen=True)
class Prepare:
    """Phase 1a: the proposer asks the members of view ``view`` to promise ``ballot``."""

    view: int
    ballot: Ballot


@dataclass(frozen=True)
class Promise:
    """Phase 1b: no ballot lower than ``ballot`` will be accepted; the value accepted so far,
    if any, and the changes the promiser knows of."""

    view: int
    ballot: Ballot
    accepted_ballot: Ballot | None
    accepted: Change | None
    requests: Requests


@dataclass(frozen=True)
class Accept:
    """Phase 2a: accept ``change`` as view ``view + 1`` under ``ballot``."""

    view: int
    ballot: Ballot
    change: Change


@dataclass(frozen=True)
class Accepted:
    """Phase 2b: the sender accepted ``change`` under ``ballot``."""

    view: int
    ballot: Ballot
    change: Change


@dataclass(frozen=True)
class Nack:
    """The sender promised a higher ballot (``promised``) than the one it was asked for."""

    view: int
    ballot: Ballot
    promised: Ballot


@dataclass(frozen=True)
class Commit:
    """View ``view + 1`` is decided: ``change``, accepted under ``ballot`` by ``accepted_by``
    (a majority of view ``view``). Sent to the old and new members and to refused joiners,
    and again to anyone who shows up still in view ``view``."""

    view: int
    ballot: Ballot
    change: Change
    accepted_by: tuple[int, ...]


Message = Beat | JoinRequest | ChangeRequest | Prepare | Promise | Accept | Accepted | Nack | Commit


@dataclass(frozen=True)
class Send:
    """One message for one rank."""

    to: int
    message: Message
