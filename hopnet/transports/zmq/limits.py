"""The numbers that shape ZmqTransport's traffic: frame sizes, when a send copies, stages or goes
zero-copy, queue bounds and timeouts.

The modules that use them read them as ``limits.NAME`` at each use, so a benchmark may set one
here (``bench/transport.py --chunk-mib``) and every part of the transport sees it."""

from __future__ import annotations

CHUNK_BYTES = 1 << 20
"""Largest tensor frame on the wire (1 MiB). Part of the wire format: both ends must agree.

libzmq receives every frame into a buffer it allocates. One frame per large tensor is
slow: above ~32 MiB glibc maps fresh pages for each (a page fault per 4 KiB, which on
the reference VM costs more than the copy). Frames of at most a few MiB come from the
reused heap; 1 MiB measured best there (docs/performance/archive.md: 16, 4, 2, 1 and 0.5 MiB were
compared, 1 MiB was as fast or faster for 16 and 64 MiB tensors, and the receiver's
copy into the destination tensor is cheapest from small, reused buffers).
"""

COPY_THRESHOLD = 64 << 10
"""Tensor frames smaller than this are copied into libzmq instead of sent zero-copy:
a 64 KiB memcpy costs less than tracking when libzmq is done with the memory."""

STAGE_BYTES = 1 << 20
"""Messages with at most this many tensor bytes (and a frame of at least
:data:`COPY_THRESHOLD`) are copied into a pooled staging buffer and
:meth:`ZmqTransport.send` returns without waiting for libzmq (see ``ZmqSending._send_staged``);
larger ones are sent zero-copy from the tensors. Measured on the reference VM: staging
made 1 MiB messages ~25% faster and 2-4 MiB ones no faster or slower."""

STAGE_INFLIGHT = 2
"""``send`` of a staged message returns once at most this many staged messages to the
peer are still in libzmq (back-pressure on a sender that outruns the link)."""

STAGE_MAX_INFLIGHT = 8
"""Past this many staged messages in libzmq for one peer (only reached with many
concurrent senders), messages are sent zero-copy instead: bounds staging memory."""

STAGE_POOL_BYTES = 32 << 20
"""Most bytes of idle staging buffers a transport keeps for reuse."""

HWM = 100_000
"""Send high-water mark, in messages per peer. A DEALER never drops outbound messages at the HWM
(it blocks), so this only bounds how much can queue for a peer that is slow or not up yet."""

RCVHWM = 8
"""Messages the ROUTER takes in ahead of the reader, per connection. libzmq reads a peer's messages
off the socket into its own frames as fast as they come, whatever the reader does with them: past
this many it stops reading that connection, and the peer's messages wait on its side (its ``send``
waits, up to ``send_timeout``). So a receiver holds at most this many messages per peer that it has
not handled: with Hop's streamed updates (chunks of ``--stream-mib``) a few MiB per in-neighbour,
where the whole update piled up before (docs/performance/archive.md, "Streamed updates")."""

MAX_FRAME_BYTES = 64 << 20
"""Largest frame the ROUTER accepts (libzmq disconnects a peer that sends a bigger one):
far above any legitimate frame (tensor frames are at most CHUNK_BYTES, headers are small),
it only keeps a confused peer from making this process allocate without bound."""

LINGER_MS = 200
"""How long ``close`` lets libzmq flush messages that are still queued."""

DEFAULT_SEND_TIMEOUT = 60.0
