"""Each protocol is one package of ``hopnet.protocols``: its declaration, algorithm and parts
together, none importing another protocol's, no import cycle between declaration and
algorithm (lazy and type-checking imports included), and a new package found with no edit
anywhere else (docs/design/adding-a-protocol.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp

from hopnet import registry

from support.env import clean_env
from support.paths import ROOT

EXAMPLE = ROOT / "examples" / "new_protocol" / "scaled_mean"
PROTOCOLS = "hopnet.protocols"


def test_every_built_in_protocol_is_a_package_with_its_declaration() -> None:
    declared = {spec.build.__module__.split(".")[2] for spec in registry.specs()
                if spec.build.__module__.startswith(PROTOCOLS + ".")}
    packages = {path.parent.name for path in (ROOT / "hopnet" / "protocols").glob("*/spec.py")}
    assert declared == packages == {"adpsgd", "allreduce", "diloco", "eager", "hop", "partial_reduce", "pipesgd",
                                    "prague"}
    assert not (ROOT / "hopnet" / "protocols" / "specs").exists()


def test_no_import_cycle_inside_the_protocols() -> None:
    graph = grimp.build_graph("hopnet", include_external_packages=False)
    modules = sorted(m for m in graph.modules if m.startswith(PROTOCOLS + "."))
    cycles = []
    for importer in modules:
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if imported.startswith(PROTOCOLS + ".") and graph.find_shortest_chain(importer=imported,
                                                                                  imported=importer):
                cycles.append(f"{importer} <-> {imported}")
    assert cycles == []


def test_a_new_protocol_is_one_new_package(tmp_path: Path) -> None:
    """The example package, dropped beside the built-ins (here: a folder added to the package's
    path, as a copy into hopnet/protocols/ would be), is a protocol of the command line and the
    simulator; its algorithm (torch) is imported only when a run builds it."""
    shutil.copytree(EXAMPLE, tmp_path / "scaled_mean")
    code = textwrap.dedent(f"""
        import sys
        import hopnet.protocols
        hopnet.protocols.__path__.append({str(tmp_path)!r})
        from hopnet import registry
        print("scaled-mean" in registry.names(), "torch" in sys.modules)
        from hopnet.cli.main import main
        code = main(["simulate", "--protocol", "scaled-mean", "--scale-by", "0.5", "--nproc", "3",
                     "--iterations", "5"])
        print(code, "hopnet.protocols.scaled_mean.protocol" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "True False"
    assert "protocol:          scaled-mean, scale_by=0.5" in proc.stdout
    assert lines[-1] == "0 True"


def test_a_package_offers_its_options_and_algorithm_by_their_old_paths() -> None:
    """``from hopnet.protocols.hop import HopOptions, HopProtocol`` still work: the options
    without torch, the algorithm imported when asked for."""
    code = ("import sys; from hopnet.protocols.hop import HopOptions; print('torch' in sys.modules); "
            "from hopnet.protocols.hop import HopProtocol; from hopnet.protocols.prague import PragueOptions, "
            "PragueProtocol; print(HopProtocol.__module__, PragueProtocol.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "hopnet.protocols.hop.protocol", "hopnet.protocols.prague.protocol"]
