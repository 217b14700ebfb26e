"""The rendezvous: where a run's workers find each other's addresses and meet at barriers.

* :mod:`~hopnet.rendezvous.server`: the server, which `hopnet launch` runs in a thread of
  the launcher process;
* :mod:`~hopnet.rendezvous.client`: what every worker calls (``exchange_addresses``,
  ``barrier``);
* :mod:`~hopnet.rendezvous.wire`: the messages and errors both sides share;
* :mod:`~hopnet.rendezvous.store`: the run's torch c10d store, hosted by the launcher (or by
  rank 0 under torchrun) and opened by every worker;
* :mod:`~hopnet.rendezvous.via_store`: the rendezvous over that store, for workers that
  torchrun or srun started (no server: every rank is a client).

Nothing is imported here: a worker loads the client without the server.
"""
