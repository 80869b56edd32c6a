"""The timing rules that need no GPU: the A/B order of the pairs, the capture spread that widens
the interval, and the thresholds of the cross-checks against the events."""

from __future__ import annotations

import time

import pytest
import torch

from harness.evaluation import timing
from harness.evaluation.timing import (
    LAUNCH_ALLOWANCE_US,
    SPAN_RATIO_LIMIT,
    WALL_RATIO_LIMIT,
    LayerSet,
    RankSync,
    StopRule,
    Timing,
    cross_check_flags,
    sample_interleaved,
    speedup_interval,
    timed_pairs,
)

CPU = torch.device("cpu")


def _sleeps(seconds: float, log: list[str], name: str):  # type: ignore[no-untyped-def]
    def call() -> None:
        log.append(name)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # spin: sleep's wake-up is too coarse
            pass

    return call


def test_pairs_alternate_and_each_side_keeps_its_own_arm() -> None:
    """A B, B A, A B, ...: whichever ran first, a pair is (a's time, b's time)."""
    order: list[str] = []
    pairs = timed_pairs(_sleeps(0.004, order, "a"), _sleeps(0.001, order, "b"), 4, CPU)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(pairs) == 4
    assert all(a_us > b_us > 900 for a_us, b_us in pairs), pairs  # a spins 4 ms, b 1 ms


class _Event:
    """A CUDA event for the order tests: records its name into the shared log; every interval
    between two of them reads `elapsed_ms`."""

    def __init__(self, log: list[str], name: str, elapsed_ms: float):
        self.log, self.name, self.elapsed_ms = log, name, elapsed_ms

    def record(self) -> None:
        self.log.append(self.name)

    def elapsed_time(self, end: _Event) -> float:
        return self.elapsed_ms


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, calls: int, elapsed_ms: float) -> list[str]:
    """torch.cuda's events, spin and synchronize replaced by a log of the order they were
    enqueued in; _cuda_intervals makes `calls` lead, start and end events in that order."""
    log: list[str] = []
    names = iter(["lead"] * calls + ["start"] * calls + ["end"] * calls)
    monkeypatch.setattr(
        torch.cuda, "Event", lambda enable_timing: _Event(log, next(names), elapsed_ms)
    )
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"spin {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    return log


def test_the_gpu_spins_before_each_start_event_outside_the_intervals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA every timed call is enqueued as: the pair's writes, the poison, the lead event,
    a spin of LEAD_CYCLES, then start, the call, end. The spin keeps the call queued before its
    start fires when the GPU has caught up with the host (quick validate 8, 2026-12-07)."""
    log = _fake_cuda(monkeypatch, 2, elapsed_ms=0.5)
    times, late = timing._cuda_intervals(
        [lambda: log.append("a"), lambda: log.append("b")],
        lambda: log.append("poison"),
        {0: [lambda: log.append("write pair 0")]},
        {1: [lambda: log.append("copy b")]},
        timing.LEAD_CYCLES,
    )
    lead = f"spin {timing.LEAD_CYCLES}"
    assert timing.LEAD_CYCLES > 0 and times == [500.0, 500.0] and late == 0
    assert log == [
        "spin 2000000",
        *("write pair 0", "poison", "lead", lead, "start", "a", "end"),
        *("poison", "lead", lead, "start", "b", "end", "copy b"),
        "sync",
    ]


def test_a_call_the_host_queued_slower_than_the_gpu_spun_is_counted_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GPU took 0.5 ms from the lead event to the start (the fake events say); a call whose
    launch kept the host 4 ms may have been started before it was queued, and is counted, in
    the sampled batches of a whole run as in one batch."""
    _fake_cuda(monkeypatch, 4, elapsed_ms=0.5)
    slow, log = _sleeps(0.004, [], "slow"), []
    _, late = timing._cuda_intervals(
        [slow, _sleeps(0, log, "quick"), _sleeps(0, log, "quick"), slow], lambda: None, {}, {}, 1
    )
    assert late == 2
    counted: list[int] = []
    _fake_cuda(monkeypatch, 4, elapsed_ms=0.5)
    timed_pairs(slow, _sleeps(0, log, "quick"), 2, torch.device("cuda"), late=counted)
    assert counted == [2]  # each pair has one slow call


class _SpinningGpu:
    """torch.cuda faked as a GPU that has caught up with the host: from each lead event to its
    start event it takes exactly the spin enqueued between them (`ns_per_cycle`: 10 makes
    500,000 cycles 5 ms, a margin no busy test host's own delays reach), and every call takes
    100 µs between its own events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ns_per_cycle: int = 10):
        self.ns_per_cycle = ns_per_cycle
        self.spins: list[int] = []
        self.recorded: list[_SpinningGpu.Event] = []
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool):
                self.spin_ms = 0.1  # a start event's interval to its end: the call

            def record(self) -> None:
                gpu.recorded.append(self)

            def elapsed_time(self, end: object) -> float:
                return self.spin_ms

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", self.spin)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def spin(self, cycles: int) -> None:
        if self.recorded:  # the lead event just recorded (the batch's first spin has none)
            self.recorded[-1].spin_ms = cycles * self.ns_per_cycle / 1e6
        self.spins.append(cycles)


def _sample(
    host_ms: float, sync: RankSync | None = None, **lead_cycles: int
) -> tuple[Timing, list[int]]:
    """sample_interleaved on the fake GPU, both arms holding the host `host_ms` per call;
    `lead_cycles=N` where given, else its default."""
    stop = StopRule(min_pairs=4, max_pairs=4, pairs_per_batch=2, captures=1)
    layer_set = LayerSet([({}, {}, {})], 0)
    arm = _sleeps(host_ms / 1000, [], "arm")
    cuda = torch.device("cuda")
    timing_ = sample_interleaved([arm], [arm], layer_set, cuda, stop, 1, sync, None, **lead_cycles)
    return timing_, timing_.stock_us


def test_a_batch_with_a_late_start_is_timed_again_with_a_longer_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call that keeps the host 7 ms is queued after a 5 ms spin ended, and before a 10 ms
    one did: the first batch is not sampled, the spin doubles, and every sampled call started
    after it was queued."""
    gpu = _SpinningGpu(monkeypatch)
    timing_, stock_us = _sample(host_ms=7.0, lead_cycles=500_000)
    assert (timing_.late_batches, timing_.lead_cycles, timing_.late_starts) == (1, 1_000_000, 0)
    assert timing_.timed_calls == 8 and stock_us == [100.0] * 4
    # the warm-up batch (late), then two sampled; each batch: 1 ms of spin up front, 4 calls
    leads = [cycles for cycles in gpu.spins if cycles != 2_000_000]
    assert leads == [500_000] * 4 + [1_000_000] * 8


def test_the_spin_grows_at_most_four_times_then_late_calls_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _SpinningGpu(monkeypatch, ns_per_cycle=1)
    timing_, _ = _sample(host_ms=9.0, lead_cycles=500_000)  # later than 16 x 0.5 ms
    assert timing.LEAD_DOUBLINGS == 4
    assert (timing_.late_batches, timing_.lead_cycles) == (4, 8_000_000)
    assert (timing_.late_starts, timing_.timed_calls) == (8, 8)


def test_a_candidate_that_zeroes_the_constant_while_timed_does_not_shorten_the_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LEAD_CYCLES set to 0 after the harness loaded (by code the candidate runs between
    batches, say, and restored before the integrity check): the spin is the default fixed at
    import, not the constant as it is when the batches run."""
    gpu = _SpinningGpu(monkeypatch)
    monkeypatch.setattr(timing, "LEAD_CYCLES", 0)
    timing_, _ = _sample(host_ms=0.0)
    assert timing_.lead_cycles == 500_000 and set(gpu.spins) == {2_000_000, 500_000}


def test_without_a_spin_nothing_is_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """lead_cycles 0 (harness_cost.py's comparison without the spin): late calls are counted,
    the batches sampled as they came."""
    _SpinningGpu(monkeypatch)
    timing_, _ = _sample(host_ms=0.2, lead_cycles=0)
    assert (timing_.late_batches, timing_.lead_cycles, timing_.late_starts) == (0, 0, 8)


def test_every_rank_times_a_batch_again_when_one_rank_started_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This rank had no late start; a peer had (the ranks' sum says 1 for the first batch):
    both must drop it, or their fixed pair schedules would part."""
    _SpinningGpu(monkeypatch)
    sums = iter([1])
    sync = RankSync(layers=lambda n: n, align=lambda: None, rank_sum=lambda n: n + next(sums, 0))
    timing_, _ = _sample(host_ms=0.0, lead_cycles=500_000, sync=sync)
    assert (timing_.late_batches, timing_.lead_cycles, timing_.late_starts) == (1, 1_000_000, 0)


def test_the_capture_spread_widens_the_interval() -> None:
    one = Timing("cuda-graph", 1, 0, [10.0] * 8, [5.0] * 8, [0] * 8)
    point, (low, high), spread = speedup_interval(one, seed=1)
    assert (point, spread) == (2.0, 0.0) and low == high == 2.0
    # two captures whose candidate medians differ by 10% of the overall median
    two = Timing("cuda-graph", 1, 0, [10.0] * 8, [4.75] * 4 + [5.25] * 4, [0] * 4 + [1] * 4)
    point, (low, high), spread = speedup_interval(two, seed=1)
    assert spread == pytest.approx(0.1)
    assert low <= point * (1 - spread) + 1e-9 and high >= point * (1 + spread) - 1e-9


def test_cross_checks_flag_only_past_their_limits() -> None:
    event, layers = 10.0, 8
    assert cross_check_flags(event, event, event, layers) == []
    span_limit = SPAN_RATIO_LIMIT * event + 1.0
    assert cross_check_flags(event, event, span_limit, layers) == []
    [span_flag] = cross_check_flags(event, event, span_limit + 0.1, layers)
    assert "profiled kernels spanned" in span_flag
    wall_limit = WALL_RATIO_LIMIT * event + LAUNCH_ALLOWANCE_US / layers
    assert cross_check_flags(event, wall_limit, event, layers) == []
    [wall_flag] = cross_check_flags(event, wall_limit + 0.1, event, layers)
    assert "the wall clock" in wall_flag and "patched timer" in wall_flag
