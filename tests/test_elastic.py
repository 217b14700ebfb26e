"""The parts of an elastic run one at a time: the membership messages on the wire, where a view
begins, who hands a joiner its state, the launcher's settings, the rendezvous's new ranks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hopnet.elastic import codec
from hopnet.elastic.run import ElasticRun
from hopnet.elastic.settings import ElasticSettings
from hopnet.elastic.setup import lone_config
from hopnet.elastic.switch import assign_donors, first_iteration
from hopnet.errors import ConfigError, HopnetError, MembershipStopped, PeerFailure
from hopnet.graph.members import MemberGraph
from hopnet.membership import (
    Accept, Accepted, Ballot, Beat, Change, ChangeRequest, Commit, JoinRequest, MembershipConfig, Nack, Prepare,
    Promise, Requests, View,
)
from hopnet.rendezvous.client import barrier, register_control, request_join
from hopnet.rendezvous.server import RendezvousServer

CHANGE = Change(View(3, (0, 1, 4, 5)), joined=(4, 5), left=(2,), died=(3,), refused=(6,))
MESSAGES = [
    Beat(2), JoinRequest(-1, 7), ChangeRequest(2, Requests((7,), (1,), (3,))), Prepare(2, Ballot(4, 1)),
    Promise(2, Ballot(4, 1), Ballot(3, 0), CHANGE, Requests((7,))), Promise(2, Ballot(4, 1), None, None, Requests()),
    Accept(2, Ballot(4, 1), CHANGE), Accepted(2, Ballot(4, 1), CHANGE), Nack(2, Ballot(4, 1), Ballot(5, 2)),
    Commit(2, Ballot(4, 1), CHANGE, (0, 1, 4)),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_membership_message_survives_the_wire(message: object) -> None:
    import msgpack

    assert codec.decode(msgpack.unpackb(msgpack.packb(codec.encode(message)))) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [{}, {"k": "Beat"}, {"k": "Nope", "v": 1}, {"k": "Commit", "v": 1, "b": [1]}])
def test_a_malformed_message_is_refused_in_one_line(data: dict[str, object]) -> None:
    with pytest.raises(HopnetError, match="malformed membership message"):
        codec.decode(data)


def test_a_view_begins_two_past_the_highest_report_at_the_protocols_safe_point() -> None:
    assert first_iteration({0: 10, 1: 12, 3: 11}, lambda k: k) == 14
    assert first_iteration({0: 10, 1: 12}, lambda k: -(-k // 8) * 8) == 16  # DiLoCo, H = 8: an outer round's start
    with pytest.raises(ValueError):
        first_iteration({}, lambda k: k)


def test_joiners_take_their_state_from_old_neighbours_spread_over_donors() -> None:
    graph = MemberGraph.build("ring", (0, 1, 2, 3, 4, 5))
    donors = assign_donors(graph, (4, 5), (0, 1, 2, 3))
    assert donors == {4: 3, 5: 0}  # each one's old neighbour on the ring
    many = assign_donors(MemberGraph.build("ring", range(8)), (4, 5, 6, 7), (0, 1, 2, 3))
    assert sorted(many.values()) == [0, 1, 2, 3]  # four joiners, four donors: never all on one
    assert all(d in (0, 1, 2, 3) for d in many.values())
    with pytest.raises(ValueError):
        assign_donors(graph, (4,), ())


def test_the_launchers_variables_read_back() -> None:
    settings = ElasticSettings("torus", 2, 8)
    environ = {"HOPNET_ELASTIC": settings.to_json()}
    assert ElasticSettings.from_environ(environ) == settings
    joiner = ElasticSettings.from_environ({**environ, "HOPNET_JOIN": "8,9"})
    assert joiner is not None and joiner.joining and joiner.batch == (8, 9)
    assert ElasticSettings.from_environ({}) is None
    with pytest.raises(ConfigError, match="HOPNET_ELASTIC"):
        ElasticSettings.from_environ({"HOPNET_ELASTIC": '{"graph": "ring"}'})
    with pytest.raises(ConfigError, match=r"need 1 <= min \(3\) <= max \(2\)"):
        ElasticSettings("ring", 3, 2)


def test_the_rendezvous_hands_out_fresh_ranks_and_the_control_table() -> None:
    with RendezvousServer(4) as server:
        with pytest.raises(ConfigError, match="this run is not elastic"):
            request_join(server.endpoint, 2, 5.0)
        server.join_info = {"command": ["python", "train.py"]}
        assert register_control(server.endpoint, 1, "tcp://127.0.0.1:5001", 5.0) == {1: "tcp://127.0.0.1:5001"}
        first = request_join(server.endpoint, 2, 5.0)
        second = request_join(server.endpoint, 1, 5.0)
        assert (first["ranks"], second["ranks"]) == ([4, 5], [6])  # a rank is never handed out twice
        assert first["control"] == {"1": "tcp://127.0.0.1:5001"} and first["info"] == server.join_info
        table = register_control(server.endpoint, 5, "tcp://127.0.0.1:5005", 5.0)
        assert table == {1: "tcp://127.0.0.1:5001", 5: "tcp://127.0.0.1:5005"}
        with pytest.raises(HopnetError):
            register_control(server.endpoint, 9, "tcp://127.0.0.1:5009", 5.0)  # a rank nobody was given
        # the workers of one `hopnet join` meet at a barrier of their own count
        other = threading.Thread(target=barrier, args=(server.endpoint, 4, "join-4", 10.0), kwargs={"count": 2})
        other.start()
        barrier(server.endpoint, 5, "join-4", 10.0, count=2)
        other.join(10.0)
        assert not other.is_alive()


class _SilentChannel:
    """A control channel over which nothing arrives (the rest of the view is across a cut)."""

    def serve(self, handler: object) -> None:
        pass

    def send(self, to: int, header: object, payload: object = None) -> None:
        pass

    async def close(self) -> None:
        pass


def _cut_off_verdict(failure: BaseException) -> BaseException:
    async def scenario() -> BaseException:
        run = ElasticRun(3, _SilentChannel(), MembershipConfig(peer_timeout=0.2), first_view=View(1, (0, 1, 2, 3)),  # type: ignore[arg-type]
                         record=lambda *a, **k: None, iteration=lambda: 7, timeout_s=5.0)
        run.start()
        try:
            return await run.verdict(failure, blamed=0)
        finally:
            await run.close()
    return asyncio.run(scenario())


def test_a_step_failed_by_silent_peers_ends_with_the_membership_line_once_it_cuts_the_worker_off() -> None:
    # the segment's peer watch fails the step first; the membership says why half a peer timeout later
    failure = PeerFailure("rank 3 cannot finish iteration 7: peer 0 went silent", peer=0, peer_state="dead")
    explained = _cut_off_verdict(failure)
    assert isinstance(explained, MembershipStopped)
    assert str(explained) == ("rank 3 is cut off from ranks 0, 1, 2 of view 1 (a majority): it stops; "
                              "the other side goes on")


def test_a_failure_that_blames_no_peer_stays_itself_while_the_membership_goes_on() -> None:
    failure = HopnetError("something else")
    assert _cut_off_verdict(failure) is failure


def _step_cut_short(rank: int, config: MembershipConfig, event: Commit | None) -> tuple[BaseException, bool]:
    """A step that would wait for ever, under a run whose membership stops the worker (a commit
    ``event`` that arrives, or silent peers): what the step raises, and whether it was cancelled."""
    async def scenario() -> tuple[BaseException, bool]:
        cancelled = False

        async def waits_for_stopped_peers() -> None:
            nonlocal cancelled
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled = True
                raise

        run = ElasticRun(rank, _SilentChannel(), config, first_view=View(0, (0, 1, 2, 3)),  # type: ignore[arg-type]
                         record=lambda *a, **k: None, iteration=lambda: 35, timeout_s=5.0)
        run.start()
        try:
            if event is not None:
                asyncio.get_running_loop().call_later(
                    0.05, run._on_control, 0, {"t": "m", "body": codec.encode(event)}, None)
            with pytest.raises(HopnetError) as ended:
                await asyncio.wait_for(run.unless_over(waits_for_stopped_peers()), timeout=4.0)
            return ended.value, cancelled
        finally:
            await run.close()
    return asyncio.run(scenario())


def test_a_leaver_whose_leave_stops_the_run_ends_its_step_at_once() -> None:
    from hopnet.elastic.run import LeftRun
    below_minimum = Commit(0, Ballot(1, 0), Change(View(1, (0, 1, 3)), left=(2,)), (0, 1, 3))
    ended, cancelled = _step_cut_short(2, MembershipConfig(peer_timeout=5.0, min_members=4), below_minimum)
    assert isinstance(ended, LeftRun) and cancelled
    assert str(ended) == "rank 2 left; view 1 has 3 members, fewer than the minimum 4: the run stops"


def test_a_worker_cut_off_in_its_step_ends_the_step_with_the_membership_line() -> None:
    ended, cancelled = _step_cut_short(3, MembershipConfig(peer_timeout=0.2), None)
    assert isinstance(ended, MembershipStopped) and cancelled
    assert str(ended) == ("rank 3 is cut off from ranks 0, 1, 2 of view 0 (a majority): it stops; "
                          "the other side goes on")


def test_a_joiner_starts_alone_on_a_protocol_that_needs_no_coordinator_and_no_backup_workers() -> None:
    alone = lone_config()
    assert alone.protocol == "allreduce" and not alone.spec.needs_coordinator(alone.options)
    assert alone.to_dict().get("backup_workers", 0) == 0


def test_a_joiner_sigtermed_before_its_admission_asks_to_leave_once_admitted() -> None:
    async def scenario() -> tuple[tuple[int, ...], list[str]]:
        recorded: list[str] = []
        run = ElasticRun(3, _SilentChannel(), MembershipConfig(peer_timeout=5.0), first_view=None,  # type: ignore[arg-type]
                         contacts=[0], record=lambda event, **k: recorded.append(event), iteration=lambda: 0,
                         timeout_s=5.0)
        run.leave()  # a SIGTERM while it waits to be admitted
        assert run.membership.state == "joining" and run.leaving
        admission = Commit(0, Ballot(1, 0), Change(View(1, (0, 1, 2, 3)), joined=(3,)), (0, 1, 2))
        run._on_control(0, {"t": "m", "body": codec.encode(admission)}, None)
        return run.membership.pending.leaves, recorded
    leaves, recorded = asyncio.run(scenario())
    assert leaves == (3,)  # it enters the view that admitted it and leaves with the next one
    assert recorded == ["leave_requested", "view_committed"]


def test_a_joiner_whose_run_ends_before_it_is_admitted_is_told_so() -> None:
    from hopnet.elastic.control import ControlChannel
    from hopnet.elastic.run import RunEnded

    async def scenario() -> str:
        member_channel, joiner_channel = ControlChannel(0, "127.0.0.1"), ControlChannel(1, "127.0.0.1")
        member_channel.open(), joiner_channel.open()
        joiner_channel.learn({0: member_channel.address})
        quiet = MembershipConfig(peer_timeout=5.0, gather_s=60.0)  # the join stays pending: no view takes it in
        member = ElasticRun(0, member_channel, quiet, first_view=View(0, (0,)), record=lambda *a, **k: None,
                            iteration=lambda: 41, timeout_s=10.0)
        joiner = ElasticRun(1, joiner_channel, quiet, first_view=None, contacts=[0], record=lambda *a, **k: None,
                            iteration=lambda: 0, timeout_s=10.0)
        member.start(), joiner.start()
        try:
            for _ in range(200):
                if member.membership.pending.joins:
                    break
                await asyncio.sleep(0.01)
            assert member.membership.pending.joins == (1,)
            member.tell_joiners_the_run_ended(41)  # the member finished training
            with pytest.raises(RunEnded) as ended:
                await joiner.admitted()
            return str(ended.value)
        finally:
            await member.close()
            await joiner.close()

    assert asyncio.run(scenario()) == "rank 1: the run ended (at iteration 41) before it was admitted"
