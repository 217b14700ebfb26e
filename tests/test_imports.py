"""Every hopnet module imports on its own, whatever was imported before it.

An import cycle hides as long as some other module happens to be imported first; each
module here is imported with every hopnet module forgotten, so a cycle fails by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, pkgutil, sys, traceback
import hopnet
names = sorted(m.name for m in pkgutil.walk_packages(hopnet.__path__, "hopnet.") if not m.name.endswith("__main__"))
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "hopnet" or m.startswith("hopnet.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print(len(names))
print("\n".join(failed))
"""


def test_every_module_imports_first() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, *failures = proc.stdout.strip().splitlines()
    assert int(count) > 40
    assert failures == [], "\n".join(failures)
