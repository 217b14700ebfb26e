"""Message numbers per directed link, and the receiver's check of them.

The sender numbers its messages to each peer from 1 within a connection *epoch*: a random
64-bit number per connection (in :class:`~hopnet.transports.zmq.ZmqTransport`, the one its
payload streams and lane tags carry: a new one per transport instance and per reset connection).
A channel that may overtake the others (express messages) is counted on its own. The numbers
ride in the header (:func:`hopnet.wire.encode_header`: ``e`` epoch, ``n`` number).

The receiver (:class:`LinkNumbers`) keeps, per sender and channel, the last number it took in each
of the sender's recent epochs, and checks every numbered message in the order it is handled:

- the next number: taken;
- a number already taken (a duplicate, or a message older than one already taken): dropped and
  counted ``duplicate``, never delivered twice;
- a number past the next one: the messages between were lost on the way (sent but never
  handled here: dropped by the sender after ``send_timeout``, by a broken payload stream, or by
  this receiver's checks). Counted ``gap`` (by how many were missed), reported once (a warning
  and the ``on_gap`` callback), and the message is taken;
- another epoch: a new connection of the sender (reset, or a new process), counted from 1 on its
  own. What the old connection still had queued was dropped by the sender and counted there.

The first message from a sender sets its count, whatever its number: a receiver that is a
replacement process joins a link whose earlier messages went to its predecessor. Unnumbered
messages (``seq`` 0: a hand-made peer) are not checked.
"""

from __future__ import annotations

from collections.abc import Callable

from hopnet.transports.base import TransportStats

EPOCHS_KEPT = 4
"""A sender's epochs whose counts a receiver remembers (a straggler of an older connection is
still checked against its own count)."""

GapReport = Callable[[int, int, int, int], None]
"""``(key, epoch, first, last)``: messages ``first..last`` of a link never came."""


def link_key(src: int, express: bool) -> int:
    """The key of a sender's channel: its rank, or ``~rank`` for its express messages."""
    return ~src if express else src


def key_source(key: int) -> tuple[int, bool]:
    """``(sender rank, express)`` of a :func:`link_key`."""
    return (~key, True) if key < 0 else (key, False)


class _Link:
    __slots__ = ("epoch", "last", "older")

    def __init__(self, epoch: int, last: int) -> None:
        self.epoch = epoch  # the sender's newest connection
        self.last = last  # the last number taken in it
        self.older: dict[int, int] = {}  # epochs before it -> their last number taken


class LinkNumbers:
    """A receiver's check of its senders' message numbers (see the module docstring)."""

    __slots__ = ("_links", "_on_gap", "_stats")

    def __init__(self, stats: TransportStats, on_gap: GapReport) -> None:
        self._stats = stats
        self._on_gap = on_gap
        self._links: dict[int, _Link] = {}

    def fresh(self, key: int, epoch: int, seq: int) -> bool:
        """Whether message ``seq`` of ``epoch`` was not taken yet (counts nothing)."""
        link = self._links.get(key)
        if link is None:
            return True
        if link.epoch == epoch:
            return seq > link.last
        last = link.older.get(epoch)
        return last is None or seq > last

    def take(self, key: int, epoch: int, seq: int) -> bool:
        """Check message ``seq`` of ``epoch`` and take it (True), or drop it as a duplicate (False)."""
        link = self._links.get(key)
        if link is not None and link.epoch == epoch and seq == link.last + 1:
            link.last = seq  # the common case, on every message: kept to a lookup and a compare
            return True
        return self._take_unusual(key, link, epoch, seq)

    def _take_unusual(self, key: int, link: _Link | None, epoch: int, seq: int) -> bool:
        if link is None:
            self._links[key] = _Link(epoch, seq)
            return True
        if link.epoch == epoch:
            last = link.last
        elif epoch in link.older:
            last = link.older[epoch]
        else:  # the sender's new connection: counted from 1
            older = link.older
            older[link.epoch] = link.last
            while len(older) >= EPOCHS_KEPT:
                del older[next(iter(older))]
            link.epoch, link.last = epoch, 0
            last = 0
        if seq <= last:
            self._stats.drop("duplicate")
            return False
        if seq > last + 1:
            self._stats.dropped["gap"] += seq - last - 1
            self._on_gap(key, epoch, last + 1, seq - 1)
        if link.epoch == epoch:
            link.last = seq
        else:
            link.older[epoch] = seq
        return True
