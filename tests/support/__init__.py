"""Helpers shared by the test modules.

- ``paths``: the repository, the test worker scripts, the examples;
- ``env``: the clean environment a test gives the processes it starts;
- ``launch``: `hopnet launch` as a user runs it, to its end or left running;
- ``records``: a run's event records, read with :func:`hopnet.analysis.load_run`, or followed as a log grows;
- ``wait``: waiting for a condition (:func:`~support.wait.wait_until`), the one way tests poll;
- ``processes``: whether a process runs, and waiting for processes to end;
- ``cluster``: workers as processes without a launcher, or in-process on the test's loop;
- ``faults``: a transport wrapper that drops, delays or cuts a rank's messages;
- ``transport_checks``: the conformance checks every transport passes;
- ``threaded``: ranks as threads of this process over the in-process transport;
- ``digits``: the examples' cached digits split;
- ``clip_task``, ``bn_task``: small training tasks shared with their DDP references.

The tests directory is on ``sys.path`` (pytest puts the rootdir conftest's folder there), so
tests import ``from support.launch import run_launch`` and the like.
"""
