"""The CPU each test of the suite costs, with everything it starts: a pytest plugin.

On a 2-core machine the suite keeps both cores busy (about 90% of its run), so its time follows the
CPU it spends, not its waits. ``--durations`` measures wall time, which a test spends waiting as often
as computing. This plugin puts each test process (the xdist workers, and the controller) in a cgroup
of its own (cgroup v1 ``cpuacct``; root), so that its tests' launchers, fork-server templates,
workers and torchrun agents are counted with it, and records the CPU of the cgroup across each test
(each test process starts a fork-server template of its own, in its cgroup: see ``_private_template``)::

    PYTHONPATH=bench python3 -m pytest -q -p suite_cpu     # as root, from the checkout's root

It writes ``suite-cpu/<pid>.jsonl`` (one line per test: its node id, CPU seconds, wall seconds) and,
at the end, prints the total and the 30 costliest tests and files. A process a test leaves running
is counted in the tests after it; so is a template's reaping of its fork servers (immediate here).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")
OUT = Path("suite-cpu")
SHOWN = 30

_group: Path | None = None
_log: Any = None
_template: contextlib.ExitStack | None = None


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py starts the session's template
def pytest_configure(config: pytest.Config) -> None:
    global _group
    if not (CGROUP_ROOT / "cpuacct.usage").exists():
        raise pytest.UsageError(f"bench.suite_cpu: {CGROUP_ROOT} (cgroup v1 cpuacct) is not mounted here")
    _group = CGROUP_ROOT / f"hopnet-suite-{os.getpid()}"
    _group.mkdir(exist_ok=True)
    (_group / "tasks").write_text(str(os.getpid()))  # what this process starts from now on is counted here
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) starts afresh
        OUT.mkdir(exist_ok=True)
        for old in OUT.glob("*.jsonl"):
            old.unlink()
    else:
        _private_template(config)


def _private_template(config: pytest.Config) -> None:
    """A template of this test process's own, in its cgroup: a template serves only launchers in its
    own cgroups, so the session's (the controller's) would serve none of this process's launches,
    and a template's forks would be counted in the template's group anyway. Each test process
    then pays a template's start (about 5 CPU-s), which the suite without this plugin pays once."""
    from support.template import forkserver_template, session_template_env, use_template

    global _template
    _template = contextlib.ExitStack()
    use_template(_template.enter_context(forkserver_template(session_template_env(config), wait=False)))


def _usage_s() -> float:
    assert _group is not None
    return int((_group / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _log
    if _log is None:
        _log = open(OUT / f"{os.getpid()}.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - open for the session
    cpu, wall = _usage_s(), time.monotonic()
    yield
    _log.write(json.dumps({"test": item.nodeid, "cpu_s": round(_usage_s() - cpu, 2),
                           "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
    _log.flush()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    rows = [json.loads(line) for path in OUT.glob("*.jsonl") for line in path.read_text().splitlines() if line]
    if not rows:
        return
    write = terminalreporter.write_line
    by_file: collections.Counter[str] = collections.Counter()
    for row in rows:
        by_file[row["test"].split("::")[0]] += row["cpu_s"]
    write(f"suite CPU: {sum(r['cpu_s'] for r in rows):.0f} s over {len(rows)} tests (bench/suite_cpu.py)")
    write("costliest files (CPU s):")
    for name, cpu in by_file.most_common(SHOWN):
        write(f"  {cpu:7.1f}  {name}")
    write("costliest tests (CPU s, wall s):")
    for row in sorted(rows, key=lambda r: -r["cpu_s"])[:SHOWN]:
        write(f"  {row['cpu_s']:7.1f} {row['wall_s']:7.1f}  {row['test']}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _template is not None:
        _template.close()
    if _log is not None:
        _log.close()
    if _group is not None:  # back to the root group; the empty group goes
        (CGROUP_ROOT / "tasks").write_text(str(os.getpid()))
        try:
            _group.rmdir()
        except OSError:
            pass  # a process it started still runs
