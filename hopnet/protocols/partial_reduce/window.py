"""Connectivity of a sliding window of groups, kept incrementally (Partial Reduce's frozen filter).

The window is a FIFO of groups: the newest joins at one end, the oldest leaves at the other.
Each group joins its members into one component. Rebuilding a union-find over the whole
window for every group costs O(window x P), and the window grows with the workers
(``3 x ceil((N - 1) / (P - 1))`` groups by default), so a run would be O(N^2).

Here the union-find has no path compression (union by size keeps ``find`` at O(log N)), so
that a group's unions can be undone. Removing the oldest group from a stack of applied
groups uses the "queue undo trick" (amortised O(log W) re-applied groups per removal,
W the window): groups are tagged A (older, stored with the oldest on top) or B (newer,
pushed since the last reversal). To remove the oldest:

* if no A is left, undo every group and re-apply them in reverse order, all tagged A, so
  the oldest is on top;
* otherwise, if the top is a B, undo groups from the top until as many A as B are undone,
  or every A is; re-apply the B then the A (each in their original order), so an A - the
  oldest group - is on top;
* undo the top group.

Besides ``find``, the filter asks which components are *live*: hold a worker that is in the
window and has not left. Each node keeps the number of live workers in its union-find
subtree, so a root knows its component's, and :attr:`live_components` counts the live
roots; both survive undo because a union only adds a child's subtree to its root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Applied:
    members: tuple[int, ...]
    older: bool  # tag A: stored with the oldest on top
    unions: list[tuple[int, int]] = field(default_factory=list)  # (child, root), in order


class WindowComponents:
    """Components of the union of the groups in a FIFO window, and which of them are live."""

    def __init__(self, size: int) -> None:
        self.parent = list(range(size))
        self._size = [1] * size
        self._live = [0] * size  # live workers in the node's union-find subtree
        self._count = [0] * size  # groups in the window that hold the worker
        self._gone = [False] * size
        self._stack: list[_Applied] = []
        self._older = 0  # groups tagged A on the stack
        self.live_components = 0

    # ------------------------------------------------------------------ queries
    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            x = parent[x]
        return x

    def is_live(self, root: int) -> bool:
        """Whether the component of ``root`` (a root) holds a worker in the window that has not left."""
        return self._live[root] > 0

    # ------------------------------------------------------------------ the window
    def push(self, members: Sequence[int]) -> None:
        """The newest group joins the window."""
        entry = _Applied(tuple(members), older=False)
        self._apply(entry)
        self._stack.append(entry)
        for rank in entry.members:
            self._count[rank] += 1
            if self._count[rank] == 1 and not self._gone[rank]:
                self._add_live(rank, 1)

    def pop_oldest(self) -> tuple[int, ...]:
        """The oldest group leaves the window; its members."""
        stack = self._stack
        if not stack:
            raise IndexError("pop from an empty window")
        if self._older == 0:
            undone = [self._undo_top() for _ in range(len(stack))]  # newest first
            for entry in undone:  # the oldest ends on top
                entry.older = True
                self._redo(entry)
            self._older = len(undone)
        elif not stack[-1].older:
            older: list[_Applied] = []
            newer: list[_Applied] = []
            while True:
                entry = self._undo_top()
                (older if entry.older else newer).append(entry)
                if len(older) == len(newer) or len(older) == self._older:
                    break
            for entry in reversed(newer):
                self._redo(entry)
            for entry in reversed(older):
                self._redo(entry)
        entry = self._undo_top()
        self._older -= 1
        for rank in entry.members:
            self._count[rank] -= 1
            if self._count[rank] == 0 and not self._gone[rank]:
                self._add_live(rank, -1)
        return entry.members

    def set_gone(self, rank: int, gone: bool) -> None:
        """A worker left (or came back): a worker that left makes no component live."""
        if self._gone[rank] == gone:
            return
        self._gone[rank] = gone
        if self._count[rank] > 0:
            self._add_live(rank, -1 if gone else 1)

    # ------------------------------------------------------------------ internals
    def _add_live(self, x: int, delta: int) -> None:
        parent, live = self.parent, self._live
        while True:
            live[x] += delta
            if parent[x] == x:
                break
            x = parent[x]
        after = live[x]
        if after - delta == 0 and after > 0:
            self.live_components += 1
        elif after == 0 and after - delta > 0:
            self.live_components -= 1

    def _apply(self, entry: _Applied) -> None:
        members = entry.members
        if len(members) < 2:
            return
        parent, size, live = self.parent, self._size, self._live
        root = self.find(members[0])
        for other in members[1:]:
            b = self.find(other)
            if b == root:
                continue
            child, root = (b, root) if size[b] <= size[root] else (root, b)
            if live[child] > 0 and live[root] > 0:
                self.live_components -= 1
            parent[child] = root
            size[root] += size[child]
            live[root] += live[child]
            entry.unions.append((child, root))

    def _undo_top(self) -> _Applied:
        entry = self._stack.pop()
        parent, size, live = self.parent, self._size, self._live
        for child, root in reversed(entry.unions):
            parent[child] = child
            size[root] -= size[child]
            live[root] -= live[child]
            if live[child] > 0 and live[root] > 0:
                self.live_components += 1
        entry.unions.clear()
        return entry

    def _redo(self, entry: _Applied) -> None:
        self._apply(entry)
        self._stack.append(entry)
