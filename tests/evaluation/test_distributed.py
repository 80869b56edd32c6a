"""run_on_ranks on CPU with gloo: results, a rank that raises, dies or hangs, nothing left running.

The rank functions live at module level: spawn pickles them by name into every rank. Each rank
records its pid (and any process it starts) in a folder, so a test can check afterwards that
every one of them is gone, not just the processes the parent knows about.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.evaluation.distributed import (
    RankCrashed,
    RanksFinished,
    RanksTimedOut,
    run_on_ranks,
    slowest_rank_us,
)

HANG_TIMEOUT_S = 2.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def _record(folder: str, rank: int, pid: int | None = None) -> None:
    pid = os.getpid() if pid is None else pid
    (Path(folder) / f"rank{rank}-{pid}").write_text(str(pid))


def sum_of_ranks(rank: int, world_size: int, folder: str) -> tuple[int, int, float]:
    _record(folder, rank)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, float(total)


def raise_on_last_rank(rank: int, world_size: int, folder: str) -> int:
    _record(folder, rank)
    if rank == world_size - 1:
        raise ValueError("deliberate failure on the last rank")
    dist.all_reduce(torch.zeros(1))  # its peers wait in a collective the last rank never joins
    return rank


def exit_on_rank_one(rank: int, world_size: int, folder: str) -> int:
    _record(folder, rank)
    if rank == 1:
        os._exit(7)  # no exception, no message: the parent only sees the process end
    return rank


def sleep_on_rank_one(rank: int, world_size: int, folder: str) -> int:
    _record(folder, rank)
    if rank == 1:
        helper = subprocess.Popen(["sleep", "1000"])  # a process the rank started
        _record(folder, rank, helper.pid)
        time.sleep(1000)
    return rank


def sleep_on_every_rank(rank: int, world_size: int, folder: str) -> int:
    _record(folder, rank)
    time.sleep(1000)
    return rank


def collective_only_on_rank_zero(rank: int, world_size: int, folder: str) -> int:
    _record(folder, rank)
    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # rank 1 never joins, and stays alive (not a crash)
    return rank


def unpicklable_result(rank: int, world_size: int, folder: str) -> object:
    _record(folder, rank)
    return lambda: rank


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited process its new parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _recorded_pids(folder: Path) -> list[int]:
    """From the file names: a rank killed while writing its file leaves it empty."""
    return [int(path.name.rsplit("-", 1)[1]) for path in folder.iterdir()]


def _children_of_this_process() -> list[int]:
    """Running descendants, except multiprocessing's resource tracker (one per parent, by
    design long-lived)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == os.getpid() and b"resource_tracker" not in command:
            children.append(int(stat.parent.name))
    return [pid for pid in children if _running(pid)]


def _assert_nothing_left(folder: Path) -> None:
    """No recorded process runs, nor any child of this one. (A failure can kill a peer before
    its function started and recorded itself: how many were recorded is up to the test.)"""
    pids = _recorded_pids(folder)
    assert pids, "no rank recorded itself"
    assert [pid for pid in pids if _running(pid)] == []
    assert _children_of_this_process() == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_returns_its_result(world_size: int, tmp_path: Path) -> None:
    outcome = run_on_ranks(sum_of_ranks, world_size, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RanksFinished)
    expected_sum = float(sum(range(world_size)))
    assert outcome.results == tuple((r, world_size, expected_sum) for r in range(world_size))
    assert outcome.root == (0, world_size, expected_sum)
    assert 0 <= outcome.run_s < 60.0
    pids = _recorded_pids(tmp_path)
    assert len(set(pids)) == world_size and os.getpid() not in pids  # one process per rank
    assert len(pids) == world_size
    _assert_nothing_left(tmp_path)


def test_a_rank_that_raises_names_itself_and_ends_its_waiting_peers(tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = run_on_ranks(raise_on_last_rank, 3, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RankCrashed)
    assert outcome.rank == 2
    assert "ValueError: deliberate failure on the last rank" in outcome.error
    assert "raise_on_last_rank" in outcome.error  # the traceback's tail, not only the message
    # its peers (in all_reduce, or not there yet) were killed, not waited for (timeout: 60 s)
    assert time.monotonic() - started < 30.0
    _assert_nothing_left(tmp_path)


def test_a_rank_that_dies_without_a_word_is_named_with_its_exit_code(tmp_path: Path) -> None:
    outcome = run_on_ranks(exit_on_rank_one, 2, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RankCrashed)
    assert outcome.rank == 1
    assert "exited with code 7" in outcome.error
    _assert_nothing_left(tmp_path)


def test_a_sleeping_rank_times_out_and_what_it_started_is_killed(tmp_path: Path) -> None:
    outcome = run_on_ranks(sleep_on_rank_one, 2, "gloo", HANG_TIMEOUT_S, (str(tmp_path),))
    assert isinstance(outcome, RanksTimedOut)
    assert outcome.ranks == (1,)  # rank 0 returned: only the sleeper is named
    assert outcome.phase == "run"
    assert HANG_TIMEOUT_S <= outcome.after_s < HANG_TIMEOUT_S + 5.0
    assert len(_recorded_pids(tmp_path)) == 3  # both ranks and rank 1's `sleep`
    _assert_nothing_left(tmp_path)


def test_a_collective_its_peer_never_joins_times_out(tmp_path: Path) -> None:
    outcome = run_on_ranks(
        collective_only_on_rank_zero, 2, "gloo", HANG_TIMEOUT_S, (str(tmp_path),)
    )
    assert isinstance(outcome, RanksTimedOut)
    assert outcome.ranks == (0,)
    assert outcome.phase == "run"
    _assert_nothing_left(tmp_path)


def test_ranks_die_with_their_parent_even_when_it_is_killed(tmp_path: Path) -> None:
    """What the worker's wall-clock kill does to an evaluation: SIGKILL, no cleanup code runs."""
    script = (
        "from harness.evaluation.distributed import run_on_ranks\n"
        "from tests.evaluation.test_distributed import sleep_on_every_rank\n"
        f"run_on_ranks(sleep_on_every_rank, 2, 'gloo', 600.0, ({str(tmp_path)!r},))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    try:
        _wait_until(lambda: len(_recorded_pids(tmp_path)) == 2, 60.0)
        pids = _recorded_pids(tmp_path)
        assert all(_running(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    _wait_until(lambda: not any(_running(pid) for pid in pids), 10.0)
    assert [pid for pid in pids if _running(pid)] == []


def _wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.05)


def test_a_slow_start_is_a_startup_timeout_naming_every_rank_not_joined(tmp_path: Path) -> None:
    # no interpreter starts and imports torch in 0.2 s: no rank can have joined the group
    outcome = run_on_ranks(sum_of_ranks, 2, "gloo", 60.0, (str(tmp_path),), startup_timeout_s=0.2)
    assert isinstance(outcome, RanksTimedOut)
    assert outcome.phase == "startup"
    assert outcome.ranks == (0, 1)
    assert _children_of_this_process() == []


def test_a_result_that_cannot_be_pickled_is_that_ranks_failure(tmp_path: Path) -> None:
    outcome = run_on_ranks(unpicklable_result, 2, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RankCrashed)
    assert "pickle" in outcome.error.lower()
    assert "lambda" in outcome.error
    _assert_nothing_left(tmp_path)


def test_bad_requests_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(sum_of_ranks, 0, "gloo", 1.0)
    with pytest.raises(ValueError, match="backend"):
        run_on_ranks(sum_of_ranks, 2, "mpi", 1.0)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="GPUs"):
            run_on_ranks(sum_of_ranks, 2, "nccl", 1.0)
    # spawn sends `fn` by name: a lambda has none (which error says so varies by Python)
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        run_on_ranks(lambda rank, world_size: rank, 2, "gloo", 1.0)
    assert _children_of_this_process() == []


def test_per_sample_time_is_the_slowest_rank() -> None:
    rank0 = [10.0, 12.0, 11.0]
    rank1 = [11.0, 9.0, 30.0]  # a straggler at the third step
    rank2 = [10.5, 12.5, 10.0]
    assert slowest_rank_us([rank0, rank1, rank2]) == [11.0, 12.5, 30.0]
    assert slowest_rank_us([rank0]) == rank0
    with pytest.raises(ValueError, match="different numbers"):
        slowest_rank_us([rank0, rank1[:2]])
    with pytest.raises(ValueError, match="no ranks"):
        slowest_rank_us([])


def where_harness_came_from(rank: int, world_size: int, folder: str) -> tuple[str, str]:
    import harness

    return str(Path(harness.__file__).resolve().parents[1]), sys.path[0]


def test_a_harness_package_in_a_checkout_does_not_replace_the_ranks_harness(
    tmp_path: Path, monkeypatch
) -> None:
    """An evaluation child puts the submitted checkout first on sys.path, and spawned ranks
    inherit it. A `harness` package in the checkout must not be what the ranks import (it
    would time and judge the case); the checkout still comes first for everything else."""
    checkout = tmp_path / "checkout"
    (checkout / "harness").mkdir(parents=True)
    (checkout / "harness" / "__init__.py").write_text("raise ImportError('the fake harness')\n")
    monkeypatch.syspath_prepend(str(checkout))
    outcome = run_on_ranks(where_harness_came_from, 2, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RanksFinished), outcome
    assert outcome.results == ((str(REPO_ROOT), str(checkout)),) * 2


def most_layers_of_all(rank: int, world_size: int, folder: str) -> int:
    from harness.evaluation.ranks import _most_of_all_ranks

    return _most_of_all_ranks(3 + 2 * rank, torch.device("cpu"))


def test_ranks_agree_on_the_layer_count_of_their_timed_graphs(tmp_path: Path) -> None:
    """A CP rank's slice (and bytes per layer) can differ from its peer's, and so the layer
    count build_layers picks for it; the ranks must all use one count, the largest."""
    outcome = run_on_ranks(most_layers_of_all, 3, "gloo", 60.0, (str(tmp_path),))
    assert isinstance(outcome, RanksFinished), outcome
    assert outcome.results == (7, 7, 7)
