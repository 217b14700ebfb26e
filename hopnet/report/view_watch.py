"""Following an elastic run's view changes as they happen, for the launcher's lines
(``hopnet launch: view 2: rank 2 left (5 workers)``): the ``view_committed`` records of every
rank log in the run directory, the joiners' included, each view said once."""

from __future__ import annotations

from pathlib import Path

from hopnet.report.rundir import LogTail, rank_logs
from hopnet.report.views import View

COMMITTED = b'"view_committed"'


class ViewWatch:
    """:meth:`poll` returns the views committed since the last call, in order, each once."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._tails: dict[int, LogTail] = {}
        self._said: set[int] = set()

    def poll(self) -> list[View]:
        for rank, path in rank_logs(self.run_dir).items():  # joiners' logs appear as they start
            if rank not in self._tails:
                self._tails[rank] = LogTail(path, containing=COMMITTED)
        new: dict[int, View] = {}
        for tail in self._tails.values():
            for record in tail.read():
                view = View.committed(record)
                if view is not None and view.number not in self._said:
                    new.setdefault(view.number, view)
        self._said.update(new)
        return [new[number] for number in sorted(new)]


__all__ = ["ViewWatch"]
