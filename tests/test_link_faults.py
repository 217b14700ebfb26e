"""Lossy and jittery links: the simulator's model of what TCP makes of them
(hopnet/transports/link_faults.py), the flags and link-model rules that set them, the kernel's
counters a worker records (hopnet/transports/tcp_diag.py), and `hopnet report` naming such a link."""

from __future__ import annotations

import json
import random
import re
import socket
import statistics
from pathlib import Path

import pytest

from hopnet import Graph, ProtocolConfig
from hopnet.errors import ConfigError
from hopnet.sim.engine import ComputeModel, SimSpec, simulate
from hopnet.sim.links import apply_rules, parse_rules
from hopnet.sim.vloop import VirtualTimeLoop
from hopnet.transports.inproc import InprocNetwork, LinkModel
from hopnet.transports.link_faults import PROBE_MIN_S, RTO_MIN_S, LinkFaults
from hopnet.transports.tcp_diag import link_counters
from hopnet.wire import Message

from support.simrun import write_sim_run


def _hop_time(link: LinkModel, seed: int = 0, model_bytes: int = 20_000) -> float:
    spec = SimSpec(graph=Graph.ring(4), config=ProtocolConfig("hop", seed=seed), iterations=300,
                   compute=ComputeModel.parse("5"), link=link, model_bytes=model_bytes)
    return simulate(spec).virtual_time


def test_a_lone_segments_loss_costs_a_probe_after_the_delayed_ack_and_a_long_message_mostly_a_round_trip() -> None:
    rng = random.Random(1)
    faults, latency, draws = LinkFaults(loss=0.05), 0.001, 40_000
    lone = [faults.extra_delay(rng, 100, latency)[0] for _ in range(draws)]
    # p * (2 RTT + RTO_MIN), plus the rarer losses of the probe itself (each an RTO more)
    expected = 0.05 * (4 * latency + RTO_MIN_S) * (1 + 0.05 * (2 * latency + RTO_MIN_S) / (4 * latency + RTO_MIN_S))
    assert statistics.fmean(lone) == pytest.approx(expected, rel=0.1)
    long = [faults.extra_delay(rng, 20_000, latency) for _ in range(draws)]  # 14 segments
    hit = [delay for delay, _ in long if delay > 0]
    assert 0.45 < len(hit) / draws < 0.60  # 1 - 0.95^14: some segment lost
    assert statistics.median(hit) == pytest.approx(2 * latency)  # most: one fast retransmit, a round trip
    tails = [delay for delay, tail in long if tail]
    assert min(tails) >= min(4 * latency + PROBE_MIN_S, 2 * latency + 2 * latency + RTO_MIN_S) - 1e-12


def test_a_lossy_link_slows_a_simulated_run_the_same_for_a_seed() -> None:
    clean = _hop_time(LinkModel(latency_s=0.001))
    lossy = LinkModel(latency_s=0.001, link_faults={(1, 2): LinkFaults(loss=0.1), (2, 1): LinkFaults(loss=0.1)})
    slowed = _hop_time(lossy)
    assert slowed > 1.5 * clean  # (2.9x)
    assert _hop_time(lossy) == slowed  # deterministic
    assert _hop_time(lossy, seed=7) != slowed  # the seed draws the losses
    assert _hop_time(LinkModel(latency_s=0.001, faults=LinkFaults(loss=0.1))) > slowed  # every link: slower


def test_jitter_spreads_arrivals_and_keeps_each_link_in_order() -> None:
    loop = VirtualTimeLoop()
    network = InprocNetwork(LinkModel(latency_s=0.05, faults=LinkFaults(jitter_s=0.02)), seed=3)
    arrivals: list[tuple[int, float]] = []

    class Receiver:
        def buffers_for(self, header: object) -> None:
            return None

        def deliver(self, msg: Message) -> None:
            arrivals.append((msg.iter, loop.time()))

    async def run() -> None:
        a, b = network.transport(0, frozenset({1})), network.transport(1, frozenset({0}))
        await a.start(Receiver())  # type: ignore[arg-type]
        await b.start(Receiver())  # type: ignore[arg-type]
        for k in range(400):
            a.send_nowait(Message("token", 0, 1, k))
            await loop.sleep(0.1)  # far apart: no message waits behind another

    loop.run_until_complete(run())
    loop.close()
    delays = [t - 0.1 * k for k, t in arrivals]
    assert [k for k, _ in arrivals] == list(range(400))
    assert min(delays) >= 0.03 - 1e-9 and max(delays) <= 0.07 + 1e-9
    assert statistics.pstdev(delays) == pytest.approx(0.02 / 3 ** 0.5, rel=0.15)  # uniform +-20 ms


def test_link_loss_and_jitter_from_flags_and_link_model_rules(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hopnet.cli.main import main

    graph = Graph(4, [(0, 1), (1, 2), (2, 3), (3, 0)], machines=["a", "a", "b", "b"])
    rules = parse_rules({"links": [{"between": ["a", "b"], "latency_ms": 50, "loss": 0.01, "jitter_ms": 20}]}, graph)
    model = apply_rules(LinkModel(latency_s=0.001), rules, graph)
    assert model.faults_of(1, 2) == LinkFaults(0.01, 0.02) and model.faults_of(2, 1) == LinkFaults(0.01, 0.02)
    assert not model.faults_of(0, 1) and model.params(1, 2) == (0.05, 0.0)
    with pytest.raises(ConfigError, match="loss"):
        parse_rules({"links": [{"between": ["a", "b"], "loss": 1.5}]}, graph)
    out = tmp_path / "sim.json"
    assert main(["simulate", "--graph", "ring:4", "--iterations", "20", "--link-latency-ms", "1", "--link-loss", "5%",
                 "--link-jitter-ms", "2", "--model-mb", "0.02", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["link"]["loss"] == 0.05
    capsys.readouterr()
    assert main(["simulate", "--link-loss", "1.0"]) == 2
    assert "--link-loss must be below 1" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(socket, "AF_NETLINK"), reason="no netlink sockets (not Linux)")
def test_the_kernel_counts_a_peers_connection() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    with server, socket.create_connection(("127.0.0.1", port)) as client:
        conn, _ = server.accept()
        with conn:
            client.sendall(b"x" * 50_000)
            got = 0
            while got < 50_000:
                got += len(conn.recv(65536))
            counters = link_counters({3: f"tcp://127.0.0.1:{port}", 4: "tcp://127.0.0.1:1"})
    assert set(counters) == {3}  # the connection to rank 3; none to rank 4's port
    assert counters[3]["segments"] >= 1 and counters[3]["retransmits"] == 0 and counters[3]["rtt_ms"] >= 0


def test_report_names_a_lossy_jittery_link_and_the_options_that_tolerate_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Link 0→3 is 52 ms away and loses 5% (the simulator made the run), and rank 0's kernel
    counted a 104 ms round trip varying by 12 ms and 4.8% of its bytes sent again."""
    from hopnet.cli.main import main

    link = LinkModel(latency_s=0.001, overrides={(0, 3): (0.052, 0.0)},
                     link_faults={(0, 3): LinkFaults(loss=0.05, jitter_s=0.018)})
    run_dir = write_sim_run(tmp_path / "run", Graph.ring(4), ProtocolConfig("hop"), link=link, iterations=40)
    for rank in range(4):
        peers = {str(p): {"rtt_ms": 0.2, "rttvar_ms": 0.1, "retransmits": 0, "segments": 500,
                          "bytes_sent": 700_000, "bytes_retransmitted": 0} for p in ((rank + 1) % 4, (rank - 1) % 4)}
        if rank == 0:
            peers["3"].update(rtt_ms=104.0, rttvar_ms=12.0, retransmits=24, bytes_retransmitted=33_600)
        with (run_dir / f"rank{rank}.jsonl").open("a") as log:
            log.write(json.dumps({"event": "links", "rank": rank, "t": 1.0, "mono": 1.0, "peers": peers}) + "\n")
    assert main(["report", str(run_dir), "-o", str(tmp_path / "page.md")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("diagnosis: ")]
    assert re.fullmatch(r"diagnosis: link 0→3: 52 ms ± 18 ms latency, 4\.8% retransmitted; "
                        r"rank 3 waits \d+% of its time on it", lines[0]), lines
    assert len([line for line in lines if line.startswith("diagnosis: link ")]) == 1, lines
    options = next(line for line in lines if line.startswith("diagnosis: options that tolerate the link"))
    assert "`--backup-workers 1 --staleness 8 --max-ig 16`" in options and "`--protocol diloco --local-steps 10`" in options


@pytest.mark.slow
def test_two_hosts_over_a_lossy_forwarder_report_the_lossy_links(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Two emulated hosts (ranks 0-1 on a, 2-3 on b) joined by the user-space forwarder, which loses
    5% of frames each way: the workers' kernels count retransmissions on the cross links (inside a
    host, a rare spurious one at most), and `hopnet report` names those links."""
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "bench"))
    from netem.forwarder import Faults, ForwardedLink, unavailable_reason

    from hopnet.cli.main import main
    from hopnet.security import CurveKeys, write_key_file
    from support.env import clean_env

    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"no emulated hosts: {why}")
    key = write_key_file(tmp_path / "run.key", CurveKeys.generate())
    script = [str(repo / "examples" / "train_digits.py"), "--iterations", "150", "--eval-every", "100000"]
    with ForwardedLink(seed=2) as link:
        link.set_faults(a_to_b=Faults(loss=0.05), b_to_a=Faults(loss=0.05))
        procs = [subprocess.Popen(link.command(host, [
            sys.executable, "-m", "hopnet.cli.main", "launch", "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", f"{link.addresses['a']}:29961", "--bind", link.addresses[host], "--nproc", "4",
            "--key-file", str(key), "--no-progress", "--run-dir", str(tmp_path / f"node{node}"), *script]),
            env=clean_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True) for node, host in enumerate("ab")]
        try:
            outs = [p.communicate(timeout=60)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    for log in (tmp_path / "node1").glob("rank*.jsonl"):  # one run directory, as the report reads it
        shutil.copy(log, tmp_path / "node0")
    cross = {(0, 3), (3, 0), (1, 2), (2, 1)}
    shares = {}
    for rank in range(4):
        records = [json.loads(line) for line in (tmp_path / "node0" / f"rank{rank}.jsonl").read_text().splitlines()]
        peers = next(r["peers"] for r in records if r["event"] == "links")
        for peer, counters in peers.items():
            shares[(rank, int(peer))] = counters["bytes_retransmitted"] / counters["bytes_sent"]
    # A starved host retransmits now and then inside itself too (over 1% once at a load of 3 on
    # 2 cores, 3.0% once at a load of 13), less than 5% loss costs the cross links.
    across = [share for link, share in shares.items() if link in cross]
    inside = [share for link, share in shares.items() if link not in cross]
    assert len(across) == 4 and min(across) >= 0.01 and max(inside, default=0.0) < min(across), shares
    capsys.readouterr()
    assert main(["report", str(tmp_path / "node0"), "-o", str(tmp_path / "page.md")]) == 0
    named = re.findall(r"diagnosis: link (\d)→(\d): .*?([0-9.]+)% retransmitted", capsys.readouterr().out)
    assert named and (int(named[0][0]), int(named[0][1])) in cross, named  # the worst link named first
    assert all(1.0 <= float(share) <= 15.0 for s, d, share in named if (int(s), int(d)) in cross), named
