"""Who caused a failed run (hopnet.launch.blame), options from flags and code (hopnet.bootstrap.options),
and the exit paths of a worker process (hopnet.runtime.shutdown), without starting processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hopnet.config import ProtocolConfig
from hopnet.errors import ConfigError, PeerFailure, WaitTimeout
from hopnet.launch.blame import RankEnd, explain, parse_log_tail, read_log_facts
from hopnet.bootstrap.options import check_coordinator_options, check_explicit, differences
from hopnet.launch.options import describe
from hopnet.runtime import shutdown


def error(rank: int, kind: str, *, mono: float, peer: int | None = None, state: str | None = None,
          it: int | None = None, code: int = 1, message: str = "boom") -> dict[str, Any]:
    return {"event": "error", "rank": rank, "t": 1.0, "mono": mono, "iter": it, "error": kind,
            "message": message, "peer": peer, "peer_state": state, "exit_code": code}


def terminated(rank: int, it: int) -> dict[str, Any]:
    return error(rank, "Terminated", mono=99.0, it=it, code=143, message="stopped by SIGTERM")


# ------------------------------------------------------------------------------- blame
def test_a_stalled_rank_is_blamed_not_the_first_to_exit() -> None:
    ends = [
        RankEnd(0, 143, stopped=True, error=terminated(0, 42), last_iter=41),
        RankEnd(1, 1, order=1, error=error(1, "WaitTimeout", mono=10.2, peer=2, it=42), last_iter=41),
        RankEnd(2, 143, stopped=True, error=terminated(2, 41), last_iter=40),
        RankEnd(3, 1, order=0, error=error(3, "WaitTimeout", mono=10.1, peer=2, it=42), last_iter=41),
    ]
    blame = explain(ends)
    assert blame is not None
    assert blame.summary == "rank 2 stalled in iteration 41: ranks 1, 3 timed out waiting for its updates"
    assert (blame.rank, blame.reason, blame.followers) == (2, "stalled", (3, 1))


def test_a_rank_that_left_early_is_blamed() -> None:
    ends = [
        RankEnd(0, 0, order=0, last_iter=19),
        RankEnd(1, 1, order=2, error=error(1, "PeerFailure", mono=5.0, peer=0, state="departed", it=21)),
        RankEnd(2, 143, stopped=True, error=terminated(2, 22), last_iter=21),
        RankEnd(3, 1, order=1, error=error(3, "PeerFailure", mono=4.9, peer=0, state="departed", it=21)),
    ]
    blame = explain(ends)
    assert blame is not None and blame.rank == 0 and blame.reason == "left early"
    assert blame.summary == ("rank 0 left after iteration 19 while its neighbours ran on to iteration 21: "
                             "ranks 1, 3 could not go on without it")


def test_blame_follows_the_chain_to_the_rank_with_an_error_of_its_own() -> None:
    ends = [
        RankEnd(0, 1, order=0, error=error(0, "PeerFailure", mono=3.0, peer=1, state="departed", it=6)),
        RankEnd(1, 1, order=1, error=error(1, "RuntimeError", mono=2.0, it=5, message="rank 1 broke")),
        RankEnd(2, 1, order=2, error=error(2, "WaitTimeout", mono=4.0, peer=1, it=6)),
        RankEnd(3, 1, order=3, error=error(3, "PeerFailure", mono=3.5, peer=0, state="departed", it=7)),
    ]
    blame = explain(ends)
    assert blame is not None and blame.rank == 1
    assert blame.summary == ("worker 1 failed in iteration 5 (exit code 1): RuntimeError: rank 1 broke; "
                             "then ranks 0, 2 failed because of it")


def test_the_first_failure_is_the_earliest_error_not_the_first_exit() -> None:
    ends = [
        RankEnd(0, 1, order=0, error=error(0, "ValueError", mono=9.0, it=3, message="late")),
        RankEnd(1, 2, order=1, error=error(1, "ConfigError", mono=1.0, code=2, message="early")),
    ]
    blame = explain(ends)
    assert blame is not None and blame.rank == 1 and blame.reason == "exit code 2"
    assert blame.summary == "worker 1 failed (exit code 2): ConfigError: early"


def test_a_killed_rank_died_and_its_neighbours_waited() -> None:
    ends = [
        RankEnd(0, 143, stopped=True, error=terminated(0, 8)),
        RankEnd(1, 1, order=1, error=error(1, "WaitTimeout", mono=5.0, peer=2, state="dead", it=8)),
        RankEnd(2, -9, order=0, last_iter=7),
    ]
    blame = explain(ends)
    assert blame is not None and blame.rank == 2 and blame.reason == "killed by SIGKILL"
    assert blame.summary == ("rank 2 died (killed by SIGKILL) while its neighbours waited in iteration 8; "
                             "then rank 1 timed out waiting for its updates")


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_rank_gone_without_a_record_comes_before_the_members_that_failed_naming_no_one(how: str) -> None:
    """A torch.distributed collective fails on every member ("Connection closed by peer") without
    naming the one that died, and their records come after the death; the dead one left none."""
    peerless = [RankEnd(r, 1, order=i, error=error(r, "HopnetError", mono=5.0 + i, it=35,
                                                   message=f"rank {r}: all-reduce failed: Connection closed by peer"))
                for i, r in enumerate((1, 3, 0))]
    gone = RankEnd(2, -9, order=3, last_iter=24, silent="stopped (state T) for 5.0 s" if how == "silent" else None)
    blame = explain([*peerless, gone])
    assert blame is not None and blame.rank == 2
    assert blame.summary == ("rank 2 died (killed by SIGKILL) after iteration 24" if how == "killed" else
                             "rank 2 went silent after iteration 24 (stopped (state T) for 5.0 s; the launcher killed it)")


def test_a_silent_peer_went_silent() -> None:
    ends = [RankEnd(0, 1, error=error(0, "WaitTimeout", mono=1.0, peer=1, state="dead", it=3)),
            RankEnd(1, -9, stopped=True, last_iter=2)]
    blame = explain(ends)
    assert blame is not None
    assert blame.summary == "rank 1 went silent while its neighbours waited in iteration 3: rank 0 timed out waiting for its updates"


def test_a_stopped_rank_is_placed_where_its_neighbours_waited_not_where_its_log_ends() -> None:
    """SIGSTOP, then the launcher's SIGKILL: its log was last flushed nine iterations back."""
    ends = [
        RankEnd(0, 143, stopped=True, error=terminated(0, 428), last_iter=427),
        RankEnd(1, 1, order=1, error=error(1, "WaitTimeout", mono=7.0, peer=3, state="dead", it=429), last_iter=428),
        RankEnd(2, 1, order=0, error=error(2, "WaitTimeout", mono=6.9, peer=3, state="dead", it=427), last_iter=426),
        RankEnd(3, -9, stopped=True, last_iter=418),
    ]
    blame = explain(ends)
    assert blame is not None and (blame.rank, blame.reason, blame.followers) == (3, "went silent", (2, 1))
    assert blame.summary == ("rank 3 went silent while its neighbours waited in iteration 427: "
                             "ranks 1, 2 timed out waiting for its updates")


def test_a_killed_rank_nobody_failed_for_is_placed_by_the_peer_dead_records() -> None:
    """Backup workers carried on without rank 2: only their ``peer_dead`` records say where they were."""
    ends = [
        RankEnd(0, 0, last_iter=99, declared_dead={2: 57}),
        RankEnd(1, 0, last_iter=99, declared_dead={2: 55, 3: 80}),
        RankEnd(2, -9, order=0, last_iter=50),
        RankEnd(3, 0, last_iter=99, declared_dead={2: 56}),
    ]
    blame = explain(ends)
    assert blame is not None and blame.rank == 2
    assert blame.summary == "rank 2 died (killed by SIGKILL) while its neighbours waited in iteration 55"
    stalled = explain([RankEnd(0, 1, error=error(0, "ValueError", mono=1.0, peer=1, it=9)),
                       RankEnd(1, -9, stopped=True, last_iter=4), RankEnd(2, 0, declared_dead={1: 8})])
    assert stalled is not None and stalled.summary == \
        "rank 1 went silent while its neighbours waited in iteration 9: rank 0 failed because of it"


def test_a_killed_rank_with_no_word_from_its_neighbours_is_placed_after_its_last_logged_iteration() -> None:
    blame = explain([RankEnd(0, 0, last_iter=20), RankEnd(1, -9, order=0, last_iter=7)])
    assert blame is not None and blame.summary == "rank 1 died (killed by SIGKILL) after iteration 7"
    blame = explain([RankEnd(0, 0), RankEnd(1, -9, order=0)])
    assert blame is not None and blame.summary == "rank 1 died (killed by SIGKILL)"


def test_sys_exit_without_records_and_no_failure_at_all() -> None:
    assert explain([RankEnd(0, 0), RankEnd(1, 3, order=0), RankEnd(2, 143, stopped=True)]).summary == \
        "worker 1 failed (exit code 3)"
    sys_exit = error(1, "SystemExit", mono=1.0, code=3, message="sys.exit(3)")
    assert explain([RankEnd(0, 0), RankEnd(1, 3, error=sys_exit)]).summary == "worker 1 failed (exit code 3)"
    assert explain([RankEnd(0, 0), RankEnd(1, 0)]) is None
    assert explain([RankEnd(0, 143, stopped=True, error=terminated(0, 1))]) is None


def test_blame_cycles_end() -> None:
    ends = [RankEnd(0, 1, error=error(0, "WaitTimeout", mono=1.0, peer=1)),
            RankEnd(1, 1, error=error(1, "WaitTimeout", mono=2.0, peer=0))]
    blame = explain(ends)
    assert blame is not None and blame.rank == 1  # 0 blames 1, 1 blames 0 (seen): stop at 1


def test_log_tail_tolerates_cut_and_corrupt_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"event": "iteration", "rank": 0, "t": 0.1 * i, "iter": i}) for i in range(5)]
    lines.insert(2, "not json at all")
    lines.append(json.dumps(error(0, "WaitTimeout", mono=1.0, peer=3, it=5)))
    text = "\n".join(lines) + '\n{"event": "stop", "rank": 0, "t'  # cut mid-record
    facts = parse_log_tail(text[7:])  # also cut at the start
    assert facts.last_iter == 4 and facts.error is not None and facts.error["peer"] == 3
    assert facts.declared_dead == {}
    dead = [{"event": "peer_dead", "rank": 0, "peer": p, "silent_s": 5.0, "iter": it}
            for p, it in ((3, 7), (1, None), (3, 9), (2, 8))]
    assert parse_log_tail("\n".join(map(json.dumps, dead))).declared_dead == {3: 7, 2: 8}  # the first, per peer
    path = tmp_path / "rank0.jsonl"
    path.write_text(text)
    assert read_log_facts(path, tail_bytes=300).error == facts.error
    assert read_log_facts(tmp_path / "missing.jsonl").error is None


# ------------------------------------------------------------------------------ options
def test_code_may_not_change_an_explicit_flag() -> None:
    flags = ProtocolConfig(max_ig=3)
    with pytest.raises(ConfigError, match=r"--max-ig 3 on the command line, max_ig=4 in hopnet.init\(\)"):
        check_explicit(flags, flags.replace(max_ig=4), {"max_ig"})
    with pytest.raises(ConfigError, match="--no-token-queues on the command line, token_queues=True"):
        check_explicit(ProtocolConfig(token_queues=False), ProtocolConfig(), {"token_queues"})
    check_explicit(flags, flags.replace(backup_workers=1), {"max_ig"})  # not explicit: fine
    assert differences(flags, flags.replace(backup_workers=1, seed=2)) == ["backup_workers", "seed"]
    assert describe(ProtocolConfig(max_ig=4, backup_workers={1: 1}, token_queues=True)) == \
        "hop --max-ig 4 --backup-workers 1:1"


# ----------------------------------------------------------------------------- shutdown
def test_exit_codes_and_error_fields() -> None:
    assert shutdown.exit_code_of(None) == 0
    assert shutdown.exit_code_of(SystemExit(3)) == 3
    assert shutdown.exit_code_of(SystemExit(None)) == 0
    assert shutdown.exit_code_of(SystemExit("bye")) == 1
    assert shutdown.exit_code_of(shutdown.Terminated()) == 143
    assert shutdown.exit_code_of(KeyboardInterrupt()) == 130
    assert shutdown.exit_code_of(RuntimeError("x")) == 1
    fields = shutdown.error_fields(WaitTimeout("updates", peer=2, iteration=7, peer_state="stalled"), 1)
    assert fields["error"] == "WaitTimeout" and fields["peer"] == 2 and fields["peer_state"] == "stalled"
    assert shutdown.iteration_of(PeerFailure("gone", peer=1, peer_state="departed", iteration=4)) == 4
    assert shutdown.error_fields(SystemExit(3), 3)["message"] == "sys.exit(3)"
    assert shutdown.error_fields(ValueError("two\nlines"), 1)["message"] == "two lines"


def test_code_may_not_change_what_the_launchers_coordinator_was_built_from() -> None:
    launched = ProtocolConfig(protocol="prague", group_generator="random")
    with pytest.raises(ConfigError, match=r"group_size=4 in hopnet.init\(\): the run's coordinator was started "
                                          r"by `hopnet launch` .* pass --group-size 4 to `hopnet launch` instead"):
        check_coordinator_options(launched, launched.replace(group_size=4))
    with pytest.raises(ConfigError, match="pass --protocol partial-reduce"):  # hop's launcher started none
        check_coordinator_options(ProtocolConfig(), ProtocolConfig(protocol="partial-reduce"))
    check_coordinator_options(launched, launched.replace(timeout_s=30.0))  # the workers' own option: fine
    check_coordinator_options(ProtocolConfig(), ProtocolConfig(seed=5, backup_workers=1))  # no coordinator at all
    static = ProtocolConfig(protocol="prague", group_generator="static")
    check_coordinator_options(static, static.replace(group_size=2))  # the static schedule runs without one
