"""A worker's bootstrap: what runs in each process a run starts, from its first line to its script.

Everything here runs in a worker (or in a process that becomes one), never only in the
launcher (:mod:`hopnet.launch`), which imports from here what it shares with its workers:

* :mod:`~hopnet.bootstrap.env`: the ``HOPNET_*`` variables, the contract between `hopnet
  launch` and its workers (the launcher writes them, a worker reads them);
* :mod:`~hopnet.bootstrap.worker_main`: the entry point `hopnet launch` runs every script
  through, with the launcher watch (:mod:`~hopnet.bootstrap.parent_watch`) and the exit
  without teardown (:mod:`~hopnet.bootstrap.quick_exit`);
* :mod:`~hopnet.bootstrap.init`: the phases of :func:`hopnet.init`; under torchrun or srun
  :mod:`~hopnet.bootstrap.external` and :mod:`~hopnet.bootstrap.attach` join the run
  (options from :mod:`~hopnet.bootstrap.env_options`, the run directory named by
  :mod:`~hopnet.bootstrap.run_name`), and :mod:`~hopnet.bootstrap.plane` wires the transport;
* :mod:`~hopnet.bootstrap.coordinator_proc` and :mod:`~hopnet.bootstrap.coordinator_main`:
  the coordinator's process, started by the launcher or, under torchrun, by rank 0's worker;
* :mod:`~hopnet.bootstrap.forkserver` and :mod:`~hopnet.bootstrap.forkserver_template`: the
  fork server process and its warm template. They run in processes of their own, not in the
  launcher: each worker is forked from the fork server and leaves its loop as that worker,
  so the server's code is the first part of every forked worker's life. The launcher's
  handle on its fork server is :mod:`hopnet.launch.forkserver`.

A worker's rendezvous client is :mod:`hopnet.rendezvous.client`. This package's own
``__init__`` imports nothing: a worker arms its launcher watch before anything heavy loads.
"""
