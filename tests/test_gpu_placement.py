"""Two ranks of a CUDA run on one GPU are refused before they start (hopnet/transports/gpu_placement.py):
NCCL would fail their pair's first send or receive, which the torch plane takes for a dead peer.
The identities are given here; on a GPU they are the host and the device's UUID."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest

from hopnet.errors import ConfigError
from hopnet.rendezvous.store import connect_store, host_store
from hopnet.transports.gpu_placement import refuse_shared_gpus


@pytest.fixture
def store_endpoint() -> Iterator[str]:
    hosted = host_store("127.0.0.1")
    yield hosted.endpoint
    hosted.close()


def publish(endpoint: str, identities: Mapping[int, str], peers: Mapping[int, set[int]],
            wait_s: float = 10.0) -> dict[int, BaseException | None]:
    """Each rank's outcome of ``refuse_shared_gpus``, the ranks in threads of their own."""
    outcome: dict[int, BaseException | None] = {}

    def run(rank: int) -> None:
        try:
            refuse_shared_gpus(connect_store(endpoint, 10), rank, peers[rank], identities[rank],
                               f"GPU {identities[rank]}", wait_s=wait_s)
            outcome[rank] = None
        except BaseException as exc:
            outcome[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in identities]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcome


TRIANGLE = {0: {1, 2}, 1: {0, 2}, 2: {0, 1}}


def test_two_ranks_on_one_gpu_are_refused_naming_both(store_endpoint: str) -> None:
    outcome = publish(store_endpoint, {0: "host/GPU-a", 1: "host/GPU-b", 2: "host/GPU-a"}, TRIANGLE)
    assert outcome[1] is None
    for rank in (0, 2):
        error = outcome[rank]
        assert isinstance(error, ConfigError), error
        assert str(error).startswith("ranks 0 and 2 are both on GPU host/GPU-a: NCCL needs a GPU of its own")


def test_one_gpu_each_starts(store_endpoint: str) -> None:
    identities = {0: "a/cuda:0", 1: "b/cuda:0", 2: "a/cuda:1"}  # the same index on another host is another GPU
    assert publish(store_endpoint, identities, TRIANGLE) == {0: None, 1: None, 2: None}


def test_a_neighbour_that_never_comes_is_left_to_the_rendezvous(store_endpoint: str) -> None:
    assert publish(store_endpoint, {0: "host/GPU-a"}, {0: {1}}, wait_s=0.3) == {0: None}
