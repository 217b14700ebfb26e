"""The fork server imports the training frameworks a script names once for all its workers
(``HOPNET_PRELOAD``, :mod:`hopnet.bootstrap.preload`), and a worker forked after such an import
still runs torch's parallel operations."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hopnet.bootstrap.forkserver_template import TEMPLATE_VAR
from hopnet.bootstrap.preload import frameworks_imported
from hopnet.launch.forkserver import available

from support.env import clean_env
from support.paths import ROOT


def test_the_frameworks_a_script_imports_are_found_at_any_depth(tmp_path: Path) -> None:
    assert frameworks_imported(ROOT / "examples" / "lightning_digits.py") == ["lightning", "hopnet.integrations.lightning"]
    assert frameworks_imported(ROOT / "examples" / "hf_trainer_lm.py") == ["transformers", "hopnet.integrations.transformers"]
    assert frameworks_imported(ROOT / "examples" / "train_digits.py") == []
    nested = tmp_path / "nested.py"
    nested.write_text("def main():\n    import accelerate.utils\n    from .local import lightning\n")
    assert frameworks_imported(nested) == ["accelerate.utils"]  # (a relative import is the script's own)
    broken = tmp_path / "broken.py"
    broken.write_text("import lightning\ndef (:\n")
    assert frameworks_imported(broken) == []
    assert frameworks_imported(tmp_path / "missing.py") == []


@pytest.mark.slow
def test_a_child_forked_after_a_preload_that_ran_a_tensor_op_runs_parallel_ops(tmp_path: Path) -> None:
    """An import that runs a tensor operation with two intra-op threads starts torch's OpenMP team;
    a child forked after that hangs in its first parallel operation. The preload holds torch at one
    thread, so the child (at two again) finishes."""
    (tmp_path / "op_at_import.py").write_text("import torch\ntorch.ones(2000, 2000).sum()\n")
    program = textwrap.dedent("""
        import os, sys, torch
        from hopnet.bootstrap.preload import preload_named
        torch.set_num_threads(2)
        preload_named({"HOPNET_PRELOAD": "op_at_import"})
        assert "op_at_import" in sys.modules and torch.get_num_threads() == 2
        pid = os.fork()
        if pid == 0:
            x = torch.randn(1000, 1000)
            (x @ x).sum()
            torch.ones(2000, 2000).sum()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(PYTHONPATH=f"{ROOT}:{tmp_path}"),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:  # a hung child (the bug) is in the program's session: it goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert out.strip() == "child 0", err[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not available(), reason="the fork server needs Linux (fork, pidfd_open)")
@pytest.mark.parametrize("preload", ["", "none"])
def test_a_launch_preloads_what_its_script_imports_unless_told_none(tmp_path: Path, preload: str) -> None:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import sys
        print("preloaded", "hopnet.integrations.accelerate" in sys.modules, flush=True)
        if len(sys.argv) > 5:  # never: the launcher finds the import all the same
            import hopnet.integrations.accelerate
    """))
    env = {k: v for k, v in clean_env().items() if k != TEMPLATE_VAR}  # a fork server of its own
    if preload:
        env["HOPNET_PRELOAD"] = preload
    result = subprocess.run([sys.executable, "-m", "hopnet.cli.main", "launch", "--nproc", "2", "--no-progress",
                             "--run-dir", str(tmp_path / "run"), str(script)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = "False" if preload == "none" else "True"
    assert result.stdout.count(f"preloaded {expected}") == 2, result.stdout
