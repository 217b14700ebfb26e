"""The commands that train nothing never import torch (issue 19: a fast command line), nor does the
launcher of a run that trains (its workers and its store do, in processes of their own).

Each command runs through ``hopnet.cli.main.main`` in one fresh interpreter, in turn; after
each, the interpreter says whether torch (and numpy) are loaded. torch loaded by one command
stays loaded, so the first command that loads it is the one named. Timings are not asserted
here: bench/cli_startup.py measures them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hopnet.launch.forkserver import available as forkserver_available

from support.env import clean_env
from support.paths import ROOT
from test_report import write_run

DRIVER = """
import contextlib, io, json, sys
from hopnet.cli.main import main

for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse: --help, a bad flag
            rc = exc.code if isinstance(exc.code, int) else 2
    print(json.dumps({"argv": argv, "rc": rc, "err": err.getvalue(), "torch": "torch" in sys.modules,
                      "numpy": "numpy" in sys.modules}))
"""


def _run(commands: list[list[str]], cwd: Path) -> list[dict[str, object]]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], capture_output=True, text=True,
                          cwd=cwd, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_commands_that_train_nothing_and_the_launcher_never_import_torch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    run_dir = write_run(tmp_path / "run")
    expected_rc = [
        (["--help"], 0),
        (["launch", "--help"], 0),
        (["simulate", "--help"], 0),
        (["graph", "show", "ring:8"], 0),
        (["graph", "make", "torus:2x2", "-o", str(tmp_path / "g.json")], 0),
        (["graph", "validate", str(tmp_path / "g.json")], 0),
        (["keygen", str(tmp_path / "run.key")], 0),
        (["launch", "nosuch.py"], 2),
        (["launch", "--no-such-flag", str(script)], 2),
        (["launch", "--max-ig", "0", str(script)], 2),
        (["launch", "--protocol", "allreduce", "--max-ig", "3", str(script)], 2),
        (["launch", "--graph", "ring:x", str(script)], 2),
        (["launch", "--protocol", "prague", "--group-generator", "static", "--graph", "ring:5", str(script)], 2),
        (["simulate", "--no-such-flag"], 2),
        (["simulate", "--protocol", "allreduce", "--max-ig", "3"], 2),
        (["simulate", "--iterations", "0"], 2),
        (["report", str(run_dir), "--no-predict", "--trace", str(tmp_path / "trace.json")], 0),
    ]
    if forkserver_available():  # a launch that trains: its workers and store import torch, forked from the fork server
        expected_rc.append((["launch", "--nproc", "2", "--no-progress", "--run-dir", str(tmp_path / "trained"),
                             str(ROOT / "examples" / "train_digits.py"), "--iterations", "2"], 0))
    results = _run([argv for argv, _ in expected_rc], tmp_path)
    assert [(r["argv"], r["rc"]) for r in results] == expected_rc, [r["err"] for r in results]
    loaded_torch = [r["argv"] for r in results if r["torch"]]
    assert not loaded_torch, f"first command to import torch: hopnet {' '.join(loaded_torch[0])}"
    assert results[0]["numpy"] is False  # `hopnet --help` lists the commands and loads nothing else
    assert (run_dir / "report.html").exists() and (tmp_path / "trace.json").exists()
    assert not list(tmp_path.glob("runs")), "an argument error left a run directory behind"


def test_compress_declares_the_codecs_the_collectives_know() -> None:
    from hopnet.collectives.compression import COMPRESSIONS
    from hopnet.protocols.compression import COMPRESSIONS as DECLARED

    assert DECLARED == COMPRESSIONS


def test_every_built_in_protocol_declares_itself_without_torch() -> None:
    code = ("import sys; from hopnet import registry; names = registry.names(); "
            "print(' '.join(names)); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    names, torch_loaded = proc.stdout.splitlines()
    assert set(names.split()) >= {"hop", "notify-ack", "allreduce", "eager-sgd", "pipe-sgd", "ad-psgd", "prague",
                                  "partial-reduce", "diloco"}
    assert torch_loaded == "False"
