"""ZeroMQ transport: one ROUTER per rank to receive, one DEALER per peer to send.

Addresses are ``tcp://HOST:PORT`` or ``ipc:///path``; the default bind address is the
loopback interface, so listening on a real network interface is always an explicit
choice of the caller.

Wire format: each :class:`~hopnet.wire.Message` is one ZeroMQ multipart message::

    [header, chunk, chunk, ...]

``header`` is :func:`hopnet.wire.encode_header`; then, for every tensor in order, its raw
bytes split into ``ceil(nbytes / CHUNK_BYTES)`` frames of at most :data:`CHUNK_BYTES`
(a 0-byte tensor is one empty frame). The header's tensor specs tell the receiver how
many frames of which sizes to expect; anything else is dropped and counted.

Identity: every DEALER's routing id is its rank (ASCII decimal), and the receiver drops
a message whose header ``src`` differs from the connection's routing id
(``spoofed_src``). The routing id is chosen by the connecting peer, so this catches
confused or buggy peers among the run's members, not an attacker. A peer's new connection
takes its routing id over from the old one (``ROUTER_HANDOVER``), which may linger half-open
after a cut link or a dead process.

Numbering (:mod:`hopnet.transports.link_numbers`): every message carries, in its header, the
epoch of the sender's connection to that peer (random, 64-bit: the ``Peer``'s, which its lane
tags and stream hellos carry too; new with every transport instance and every reset) and its
number in it, from 1, in the order of the ``send`` calls across ZeroMQ and the payload stream.
Express messages are counted on their own (they may overtake). The receiver checks each
message when it is handled, in order (for a streamed one: before a byte lands in a buffer):
a number already taken is dropped (``duplicate``), never delivered twice; a number past the
next one means the messages between were sent but lost (``gap`` counts them, a warning and a
``link_gap`` record in the receiver's event log name the link and the numbers once), and the
message is delivered; a new epoch is a new count (what the old connection had queued was
dropped and counted by the sender, ``send_timeout``). The torch plane's headers go over this
transport, so its messages are checked too.

Security: given the run's CURVE keys (``curve=``, see :mod:`hopnet.security`), the ROUTER
is a CURVE server that admits only holders of the run key and every DEALER a CURVE
client: traffic is encrypted, and a process without the key gets no message in. Its
refused connection attempts are counted in ``stats.dropped`` as ``unauthenticated``
(a lower bound: see :class:`~hopnet.security.HandshakeWatch`). Without keys the sockets are
plain: fine on loopback, and what ``hopnet launch --insecure`` asks for elsewhere.

Sending (:meth:`ZmqTransport.send` returns once the caller may modify the tensors):

- no frame of :data:`COPY_THRESHOLD` bytes or more (every control message): libzmq copies
  the frames in one non-blocking call; no Futures, no completion tracking;
- at most :data:`STAGE_BYTES` of tensors: copied into a pooled staging buffer that libzmq
  sends from, so the next message can queue while this one is written;
- larger: zero-copy from the tensors' memory, and ``send`` waits until libzmq has
  released every frame (written it to the kernel).

Before all of these: a message with at least ``payload_stream.MIN_BYTES`` of tensors, to a
peer whose address names a data port (``tcp://HOST:PORT?data=DPORT``), goes whole (header
and tensor bytes) over a plain TCP stream to that peer, which receives the bytes straight
into its buffers; the ZeroMQ messages to such a peer carry a lane tag that keeps the order
across the two channels (:mod:`hopnet.transports.payload_stream`: wire, order, failures).
Off with CURVE keys, ``ipc://``, ``payload_stream=False`` or ``HOPNET_ZMQ_PAYLOAD_STREAM=0``.

Messages to one peer leave in the order of the ``send`` calls, also when ``send`` is
called from several tasks at once.

Links slower than the sender (:meth:`ZmqTransport.send_latest`): while anything with
tensors to a peer is still in libzmq, a ``send_latest`` message is not queued behind it
but copied aside, one per peer, a newer one replacing it, and handed to libzmq when the
earlier messages have left. A sender that outruns its link then keeps one update waiting
instead of a growing backlog, and what it sends is its newest. Later ``send`` calls (a
token, a beat) do not wait behind the held message.

Receiving: the event loop watches the ROUTER's file descriptor and a reader callback
drains it, validates each message, asks the receiver for buffers and copies the frames
into them (or into new tensors), then calls ``deliver``. No exception escapes it.

Peers that are not up yet: DEALERs connect with ``IMMEDIATE`` off, so messages queue
(up to :data:`HWM` messages per peer) until the connection is made. Peers that are gone:
a send that cannot complete within ``send_timeout`` seconds (the peer has not taken the
bytes, or the queue is full) is dropped, counted as ``send_timeout`` in
``stats.dropped``, the DEALER to that peer is recreated (its queued messages are
dropped with it, releasing their memory; the new one is a new epoch) and :meth:`send`
returns. So ``send`` never blocks forever; messages to a dead peer are lost, as on any
network. A message cut off mid-way by a broken link is never delivered: a ZeroMQ message
arrives whole or not at all, and a streamed one is delivered only once all its bytes are in.

The package's modules:

- ``transport``: :class:`ZmqTransport`, its lifecycle and its peers coming and going;
- ``state``: the state its parts share (``ZmqState``, which takes the constructor's arguments);
- ``sending``: ``send``, ``send_express``, and copied, staged and zero-copy sends;
- ``latest``: ``send_latest`` and ``drain`` (the held message of a busy link);
- ``stream_sending``: large messages over a peer's payload stream;
- ``receiving``: the ROUTER's reader, the checks on inbound messages, streamed messages' delivery;
- ``peer``: one peer's connection and what is in flight to it;
- ``send_memory``: zero-copy send completion and the staging buffer pool;
- ``frames``: a message as ZeroMQ frames and back;
- ``addresses``: routing ids and addresses;
- ``limits``: the numbers (frame size, staging, queue bounds, timeouts);
- ``malloc``: glibc's malloc tuned for message buffers.
"""

from hopnet.transports.zmq.addresses import express_routing_id, routing_id, zmq_endpoint
from hopnet.transports.zmq.limits import (
    CHUNK_BYTES,
    COPY_THRESHOLD,
    DEFAULT_SEND_TIMEOUT,
    HWM,
    LINGER_MS,
    MAX_FRAME_BYTES,
    RCVHWM,
    STAGE_BYTES,
    STAGE_INFLIGHT,
    STAGE_MAX_INFLIGHT,
    STAGE_POOL_BYTES,
)
from hopnet.transports.zmq.malloc import prefer_low_memory, tune_malloc
from hopnet.transports.zmq.transport import ZmqTransport

__all__ = [
    "CHUNK_BYTES",
    "COPY_THRESHOLD",
    "DEFAULT_SEND_TIMEOUT",
    "HWM",
    "LINGER_MS",
    "MAX_FRAME_BYTES",
    "RCVHWM",
    "STAGE_BYTES",
    "STAGE_INFLIGHT",
    "STAGE_MAX_INFLIGHT",
    "STAGE_POOL_BYTES",
    "ZmqTransport",
    "express_routing_id",
    "routing_id",
    "prefer_low_memory",
    "tune_malloc",
    "zmq_endpoint",
]
