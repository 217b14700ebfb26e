"""Hop's iteration-gap theorems (Table 1, Theorems 1-2) checked on the real protocol in virtual time.

For every setting, random strongly connected graphs (a random Hamiltonian cycle plus
random extra edges, directed or undirected, 3..12 nodes), uneven per-rank compute
times and random slowdowns are simulated, and the largest observed
``Iter(i) - Iter(j)`` (``SimResult.max_gap[i][j]``) is checked against Hop's Table 1
bound for every ordered pair. ``d(a, b)`` is the shortest path length a -> b.

=======================================  ====================================
setting                                  bound on Iter(i) - Iter(j)
=======================================  ====================================
standard, no token queues (Theorem 1)    d(j,i)
standard with token queues (Theorem 2)   min(d(j,i), max_ig * d(i,j))
bounded staleness s, no token queues     (s+1) * d(j,i)
bounded staleness s with token queues    min((s+1) * d(j,i), max_ig * d(i,j))
backup workers (with token queues)       max_ig * d(i,j)
notify-ack                               min(d(j,i), 2 * d(i,j))
serial approach                          as standard
=======================================  ====================================

Alongside, the update queue must stay within its capacity and the token counts within
Hop Sec. 4.2's ``TokenQ.size() <= max_ig * (length(Path) + 1)``. Each setting also has a
deterministic case on a fixed graph where the observed gap *equals* the bound,
showing the bound is tight for hopnet's implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hopnet import Graph, ProtocolConfig
from hopnet.sim.engine import ComputeModel, SimResult, SimSpec, simulate

Bound = Callable[[np.ndarray, int, int, ProtocolConfig], int]

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------- bounds (Table 1)
def opt(cfg: ProtocolConfig, name: str) -> Any:
    """Option ``name`` of ``cfg``'s protocol, ``None`` when the protocol does not take it (notify-ack)."""
    return cfg.to_dict().get(name)


def standard(d: np.ndarray, i: int, j: int, cfg: ProtocolConfig) -> int:
    """Theorem 1, and Theorem 2 when token queues are on."""
    if not opt(cfg, "token_queues"):
        return int(d[j][i])
    return int(min(d[j][i], opt(cfg, "max_ig") * d[i][j]))


def staleness(d: np.ndarray, i: int, j: int, cfg: ProtocolConfig) -> int:
    assert opt(cfg, "staleness") is not None
    b0 = (opt(cfg, "staleness") + 1) * d[j][i]
    return int(min(b0, opt(cfg, "max_ig") * d[i][j]) if opt(cfg, "token_queues") else b0)


def backup(d: np.ndarray, i: int, j: int, cfg: ProtocolConfig) -> int:
    """Backup workers (alone, with staleness or with skipping): only the token queues bound the gap."""
    return int(opt(cfg, "max_ig") * d[i][j])


def notify_ack(d: np.ndarray, i: int, j: int, cfg: ProtocolConfig) -> int:
    return int(min(d[j][i], 2 * d[i][j]))


# ---------------------------------------------------------------------------- checking a run
def check_run(g: Graph, cfg: ProtocolConfig, iterations: int, r: SimResult, bound: Bound) -> None:
    """Every Table 1 bound, the update-queue capacity and the token-queue capacity."""
    n = g.n
    d = g.shortest_path_lengths()
    skipped = [0] * n
    for event in r.skips:
        assert event["to"] > event["iter"] + 1
        skipped[event["rank"]] += event["to"] - event["iter"] - 1
    assert [len(t) + s for t, s in zip(r.finish_times, skipped)] == [iterations] * n, "every worker must finish"
    assert r.iterations == [iterations] * n
    gap = r.max_gap
    assert gap.shape == (n, n)
    assert (np.diag(gap) == 0).all()
    for i in range(n):
        for j in range(n):
            if i != j:
                b = bound(d, i, j, cfg)
                assert gap[i][j] <= b, (f"Iter({i}) - Iter({j}) reached {gap[i][j]} > bound {b} "
                                        f"(d({j},{i})={d[j][i]}, d({i},{j})={d[i][j]}, {cfg})")

    # Update queue: it holds in-neighbours' updates only (a worker's own never enters it).
    for i in range(n):
        ins = g.in_peers(i)
        if opt(cfg, "staleness") is not None:
            cap = len(ins)  # only the newest update per in-neighbour is kept (Sec. 6.1)
        elif cfg.protocol == "notify-ack":
            cap = 3 * len(ins)  # an in-neighbour is at most 2 iterations ahead (Table 1)
        elif opt(cfg, "token_queues"):
            cap = (1 + opt(cfg, "max_ig")) * len(ins)  # Sec. 4.2
        else:
            cap = sum(1 + int(d[i][j]) for j in ins)  # Sec. 4.1: length(Path_i->j) + 1 per in-neighbour
        assert r.queue_high_water[i] <= cap, f"rank {i}: queue reached {r.queue_high_water[i]} > {cap}"

    # Token queues. TokenCredits at worker i counts, per out-neighbour j, the tokens of the
    # paper's TokenQ(j -> i) (kept at j in Hop), i.e. Iter(j) - Iter(i) + max_ig; high_water
    # is the most held for any out-neighbour. Sec. 4.2 / Table 1 caption bound that queue by
    # max_ig * (length(Path_j->i) + 1): note the path runs from the out-neighbour j back to i.
    if opt(cfg, "token_queues") and cfg.protocol == "hop":
        for i in range(n):
            outs = g.out_peers(i)
            paper = max(opt(cfg, "max_ig") * (int(d[j][i]) + 1) for j in outs)
            assert r.token_high_water[i] <= paper, f"rank {i}: {r.token_high_water[i]} tokens > {paper}"
            # and consistent with the gaps observed: tokens(j) = Iter(j) - Iter(i) + max_ig
            observed = opt(cfg, "max_ig") + max(int(gap[j][i]) for j in outs)
            assert r.token_high_water[i] <= observed


def run(g: Graph, cfg: ProtocolConfig, iterations: int, compute: ComputeModel, bound: Bound) -> SimResult:
    r = simulate(SimSpec(g, cfg, iterations, compute))
    check_run(g, cfg, iterations, r, bound)
    return r


# ---------------------------------------------------------------------------- strategies
@st.composite
def graphs(draw: st.DrawFn, undirected: bool | None = None) -> Graph:
    """A random Hamiltonian cycle (so the graph is strongly connected) plus random extra edges."""
    n = draw(st.integers(3, 12))
    order = draw(st.permutations(range(n)))
    edges = {(order[k], order[(k + 1) % n]) for k in range(n)}
    extra = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    edges |= {(a, b) for a, b in extra if a != b}
    if undirected is None:
        undirected = draw(st.booleans())
    if undirected:
        edges |= {(b, a) for a, b in edges}
    return Graph(n, sorted(edges))


def _model(draw: st.DrawFn) -> ComputeModel:
    kind = draw(st.sampled_from(["const", "uniform", "exp"]))
    mean = draw(st.integers(1, 30))
    text = {"const": f"{mean}", "uniform": f"uniform:{mean / 2:g}:{mean * 1.5:g}", "exp": f"exp:{mean}"}[kind]
    return ComputeModel.parse(text)


@st.composite
def computes(draw: st.DrawFn, n: int) -> ComputeModel:
    """A default model plus, for some ranks, their own (different kinds and means: uneven workers)."""
    model = _model(draw)
    for rank in range(n):
        if draw(st.booleans()):
            model = model.with_rank(rank, _model(draw))
    return model


@st.composite
def slowdowns(draw: st.DrawFn, n: int) -> list[str]:
    specs = []
    if draw(st.booleans()):
        specs.append(f"random:{draw(st.sampled_from([2, 4, 8]))}:{draw(st.sampled_from([0.05, 0.2, 0.5]))}")
    if draw(st.booleans()):
        specs.append(f"rank={draw(st.integers(0, n - 1))}:{draw(st.sampled_from([2, 5, 20]))}")
    return specs


@st.composite
def cases(draw: st.DrawFn, make: Callable[[st.DrawFn], dict], undirected: bool | None = None
          ) -> tuple[Graph, ProtocolConfig, int, ComputeModel]:
    g = draw(graphs(undirected))
    options = make(draw)
    cfg = ProtocolConfig(slowdown=draw(slowdowns(g.n)), seed=draw(st.integers(0, 2**16)), **options)
    return g, cfg, draw(st.integers(30, 60)), draw(computes(g.n))


max_ig = st.integers(1, 4)
stale = st.integers(0, 3)


# ---------------------------------------------------------------------------- property tests
@SETTINGS
@given(cases(lambda draw: {"token_queues": False}))
def test_standard_without_token_queues(case):
    run(*case, standard)


@SETTINGS
@given(cases(lambda draw: {"max_ig": draw(max_ig)}))
def test_standard_with_token_queues(case):
    run(*case, standard)


@SETTINGS
@given(cases(lambda draw: {"serial": True, "token_queues": draw(st.booleans()), "max_ig": draw(max_ig)}))
def test_serial_approach(case):
    run(*case, standard)


@SETTINGS
@given(cases(lambda draw: {"staleness": draw(stale), "token_queues": False}))
def test_bounded_staleness_without_token_queues(case):
    run(*case, staleness)


@SETTINGS
@given(cases(lambda draw: {"staleness": draw(stale), "max_ig": draw(max_ig)}))
def test_bounded_staleness_with_token_queues(case):
    run(*case, staleness)


@SETTINGS
@given(cases(lambda draw: {"backup_workers": 1, "max_ig": draw(max_ig)}))
def test_backup_workers(case):
    run(*case, backup)


@SETTINGS
@given(cases(lambda draw: {"backup_workers": 1, "staleness": draw(stale), "max_ig": draw(max_ig)}))
def test_hybrid_backup_workers_and_staleness(case):
    run(*case, backup)


@SETTINGS
@given(cases(lambda draw: {"backup_workers": 1, "max_ig": draw(max_ig), "skip_threshold": draw(st.integers(1, 3)),
                           "max_jump": draw(st.integers(1, 4))}))
def test_backup_workers_with_skipping(case):
    run(*case, backup)


@SETTINGS
@given(cases(lambda draw: {"protocol": "notify-ack", "serial": draw(st.booleans())}))
def test_notify_ack(case):
    g, cfg, iterations, compute = case
    r = run(g, cfg, iterations, compute, notify_ack)
    # hopnet waits for the acks of iteration k-1 before *entering* k (in both approaches), so a
    # worker is never more than 1 iteration ahead of an out-neighbour: the paper's factor 2
    # becomes 1 and the bound is min(d(j,i), d(i,j)), stricter than Table 1's.
    d = g.shortest_path_lengths()
    strict = np.minimum(d.T, d)
    assert (r.max_gap <= strict).all()


# ---------------------------------------------------------------------------- tightness
def directed_ring(n: int) -> Graph:
    return Graph(n, [(i, (i + 1) % n) for i in range(n)], name=f"directed_ring:{n}")


# Rank 0 takes 1000 ms an iteration, everyone else 1 ms: the others run ahead as far as
# the protocol lets them, so the largest gaps are the bounds themselves.
STRAGGLER = ComputeModel.parse("1").with_rank(0, ComputeModel.parse("1000"))

TIGHT = [
    # (id, graph, config, bound, pair (i, j), value: the bound at that pair and which term is binding)
    ("standard/no-tokens d(j,i)", directed_ring(8), ProtocolConfig(token_queues=False), standard, (7, 0), 7),
    ("standard/no-tokens undirected", Graph.ring(8), ProtocolConfig(token_queues=False), standard, (4, 0), 4),
    ("standard/tokens d(j,i)", directed_ring(8), ProtocolConfig(max_ig=2), standard, (5, 0), 5),
    ("standard/tokens max_ig*d(i,j)", directed_ring(8), ProtocolConfig(max_ig=2), standard, (6, 0), 4),
    ("staleness/no-tokens", directed_ring(8), ProtocolConfig(staleness=1, token_queues=False), staleness, (7, 0), 14),
    ("staleness/tokens (s+1)*d(j,i)", directed_ring(8), ProtocolConfig(staleness=1, max_ig=3), staleness, (3, 0), 6),
    ("staleness/tokens max_ig*d(i,j)", directed_ring(8), ProtocolConfig(staleness=1, max_ig=3), staleness, (5, 0), 9),
    ("backup directed", directed_ring(8), ProtocolConfig(backup_workers=1, max_ig=2), backup, (1, 0), 14),
    ("backup undirected", Graph.ring(8), ProtocolConfig(backup_workers=1, max_ig=2), backup, (3, 0), 6),
    ("backup+skipping", Graph.ring(8), ProtocolConfig(backup_workers=1, max_ig=2, skip_threshold=1, max_jump=1),
     backup, (3, 0), 6),
    ("hybrid", directed_ring(8), ProtocolConfig(backup_workers=1, staleness=1, max_ig=2), backup, (1, 0), 14),
    ("notify-ack d(j,i)", directed_ring(8), ProtocolConfig(protocol="notify-ack"), notify_ack, (3, 0), 3),
    ("serial d(j,i)", directed_ring(8), ProtocolConfig(serial=True, max_ig=9), standard, (7, 1), 6),
    ("serial max_ig*d(i,j)", directed_ring(8), ProtocolConfig(serial=True, max_ig=2), standard, (6, 0), 4),
]


@pytest.mark.parametrize("graph,cfg,bound,pair,value", [t[1:] for t in TIGHT], ids=[t[0] for t in TIGHT])
def test_bound_is_reached(graph, cfg, bound, pair, value):
    r = run(graph, cfg, 60, STRAGGLER, bound)
    i, j = pair
    assert bound(graph.shortest_path_lengths(), i, j, cfg) == value
    assert r.max_gap[i][j] == value
    if opt(cfg, "skip_threshold") is not None:
        assert r.skips and {e["rank"] for e in r.skips} == {0}  # the straggler did skip


def test_token_and_queue_capacities_are_reached():
    """Sec. 4.2: TokenQ.size() reaches max_ig * (length(Path) + 1); UpdateQ reaches (1+max_ig)|N_in|."""
    g = directed_ring(8)
    # With backup workers rank 1 runs max_ig * 7 iterations ahead of the straggler, so the
    # straggler holds max_ig * (d(1, 0) + 1) = 2 * 8 tokens of its out-neighbour 1.
    r = run(g, ProtocolConfig(backup_workers=1, max_ig=2), 60, STRAGGLER, backup)
    assert r.token_high_water[0] == 2 * (g.path_length(1, 0) + 1) == 16
    # Standard: the straggler's in-neighbour 7 gets max_ig ahead, so max_ig + 1 of its updates wait.
    r = run(g, ProtocolConfig(max_ig=2), 60, STRAGGLER, standard)
    assert r.queue_high_water[0] == (1 + 2) * len(g.in_peers(0)) == 3


def test_notify_ack_factor_two_is_never_reached():
    """Table 1's notify-ack term 2 * d(i,j) is not reached: hopnet is stricter (see test_notify_ack).
    On a directed ring with rank 1 straggling, rank 7 (whose out-neighbour is 0) has Table 1 bound
    min(d(0,7), 2 * d(7,0)) = min(7, 2) = 2 over rank 0, but gets only 1 ahead of it: rank 0
    acknowledges iteration k as soon as it has mixed it, then waits for rank 1's ack before it
    enters k + 1, and rank 7 needs the ack of k + 1 from rank 0 to enter k + 2."""
    g = directed_ring(8)
    straggler_1 = ComputeModel.parse("1").with_rank(1, ComputeModel.parse("1000"))
    r = run(g, ProtocolConfig(protocol="notify-ack"), 60, straggler_1, notify_ack)
    assert notify_ack(g.shortest_path_lengths(), 7, 0, ProtocolConfig()) == 2
    assert r.max_gap[7][0] == 1
    for i in range(8):  # no worker ever gets 2 ahead of its out-neighbour
        assert r.max_gap[i][(i + 1) % 8] <= 1


def test_skip_on_directed_graph_stays_within_reach_of_in_neighbours():
    """Rank 4 (20x slower) is in iteration 0 when its out-neighbour 3 reaches iteration 4 (4 > 2 =
    skip_threshold). Its in-neighbours 2 and 5 cannot pass iteration max_ig = 1 without rank 4's
    tokens, so a jump to 0 + 1 + min(max_jump=4, 4 - 1) = 4 would wait for their updates of
    iteration 3 forever; hopnet caps the jump at max_ig so the run completes, within the bounds."""
    g = Graph(6, [(0, 1), (1, 2), (2, 4), (2, 5), (3, 0), (4, 3), (5, 4)])
    cfg = ProtocolConfig(max_ig=1, backup_workers=1, skip_threshold=2, max_jump=4, slowdown=["rank=4:20"],
                         timeout_s=5)
    result = run(g, cfg, 30, ComputeModel.parse("10"), backup)
    assert all(it == 30 for it in result.iterations)

