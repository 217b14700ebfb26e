"""Why Hop cannot finish an iteration: the in-neighbours whose updates will never come (dead, or
gone), named in the words of the error a worker fails with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hopnet.errors import PeerFailure
from hopnet.protocols.local_steps import mixing_iteration, round_of

if TYPE_CHECKING:
    from hopnet.protocols.hop.state import HopState


def peer_failure(hop: HopState, k: int, need: int) -> PeerFailure:
    """Iteration ``k`` needs an update that departed or dead in-neighbours will never send."""
    gone = sorted(j for j in hop.in_peers if j not in hop.expected_senders(k))
    # Blame a peer that said nothing before one that said goodbye: a dead peer is the cause,
    # the others may only have left because of it.
    peer = next((j for j in gone if hop.node.peer_state(j) == "dead"), gone[0])
    state = hop.node.peer_state(peer)
    need_text = (f"rank {hop.rank} needs {need} of its {len(hop.in_peers)} in-neighbours' "
                 f"updates with {hop.n_buw} backup workers")
    others = [j for j in gone if j != peer]
    also = f"; in-neighbour(s) {others} are gone too" if others else ""
    cause = hop.node.death_causes.get(peer)
    if state == "dead" and cause is not None:
        message = (f"rank {hop.rank} cannot finish {round_in_words(hop, k)}: peer {peer} is gone "
                   f"(dead: {cause}) and {need_text}{also}")
    elif state == "dead":
        silent = hop.node.dead.get(peer, 0.0)
        message = (f"rank {hop.rank} cannot finish {round_in_words(hop, k)}: peer {peer} went silent "
                   f"(dead: rank {peer} unreachable from rank {hop.rank}, nothing heard from it for {silent:.1f}s; "
                   f"its host or the link to it is down, or its process hangs) and {need_text}{also}")
    else:
        message = _departure_text(hop, peer, k, need_text) + also
    return PeerFailure(message, peer=peer, peer_state=state, iteration=k)


def _departure_text(hop: HopState, peer: int, k: int, need_text: str) -> str:
    last = hop.departed_after[peer]
    final = hop.node.final_iterations.get(peer)
    mine = hop.final_iteration
    if final is not None and last >= round_of(final, hop.local_steps) and (mine is None or mine > final):
        runs_to = (f"runs to iteration {mine}" if mine is not None
                   else f"needs its update of {round_in_words(hop, k)}")
        return (f"peer {peer} finished at iteration {final} but rank {hop.rank} {runs_to}: "
                "every rank must run the same number of iterations")
    if final is not None and last < round_of(final, hop.local_steps):
        return (f"rank {hop.rank} cannot finish {round_in_words(hop, k)}: peer {peer} left at "
                f"{round_in_words(hop, last)}, before its last iteration {final}, and {need_text}")
    return (f"rank {hop.rank} cannot finish {round_in_words(hop, k)}: peer {peer} left after "
            f"{round_in_words(hop, last)} and {need_text}")


def round_in_words(hop: HopState, r: int) -> str:
    """Round ``r`` in words: its iteration, or with local steps the round and where it mixes."""
    if hop.local_steps == 1:
        return f"iteration {r}"
    return f"round {r} (iteration {mixing_iteration(r, hop.local_steps, hop.final_iteration)})"
