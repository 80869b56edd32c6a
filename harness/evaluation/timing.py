"""Timing: stock and candidate interleaved on one device, per-layer time, a stop rule.

On CUDA each path is captured once into a CUDA graph holding `layers` calls, each with its own
weights, inputs and outputs (together more bytes than L2 where memory allows, so no layer is
served from cache), and the graphs are replayed alternately (A B, B A, ...), each replay between
two CUDA events. A spin kernel before each batch of replays lets the host run ahead, and a
shorter one before each replay's start event keeps its launch out of the events; a batch in
which a replay may still have started before it was queued is timed again with a longer spin.
Per-layer time = replay time / layers. On CPU the same loop times eager calls with the host
clock; those numbers are not GPU evidence.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.evaluation.cases import Case
from harness.evaluation.correctness import (
    REFERENCE_DTYPE,
    cosine_similarity,
    pooled_comparable_rows,
    relative_error,
)
from harness.evaluation.integrity import require_plain_tensors
from harness.evaluation.loading import LoadedPath, PathFn
from harness.evaluation.plan import derive_seed
from harness.evaluation.stats import median, speedup_ci95

Tensors = dict[str, torch.Tensor]

# The GPU's spin before each timed call's start event (_cuda_intervals): ~0.25 ms at ~2 GHz,
# several times the host's launch of a timed graph. GPU time outside the events (20 calls a
# batch: ~5 ms), charged to neither arm. A batch with a call that may still have started late
# doubles it, at most LEAD_DOUBLINGS times (sample_interleaved).
LEAD_CYCLES = 500_000
LEAD_DOUBLINGS = 4


@dataclass(frozen=True)
class StopRule:
    """Sample at least min_pairs; then stop at max_pairs, after max_seconds, or once the
    speedup's 95% CI is narrower than ci_relative_width of its value."""

    min_pairs: int = 30
    max_pairs: int = 1000
    max_seconds: float = 10.0
    ci_relative_width: float = 0.01  # stop once (high - low) / point of the speedup is below
    pairs_per_batch: int = 10  # pairs enqueued between two checks of the rule
    # CUDA graphs captured per path. Two captures of the same code can differ by ~1% (their
    # intermediates land at other addresses); batches rotate through the captures and the
    # spread between them widens the reported interval.
    captures: int = 3


@dataclass
class LayerSet:
    """`layers` independent argument sets for one path, each called once per step."""

    args: list[tuple[Tensors, Tensors, Tensors]]
    working_set_bytes: int


@dataclass
class Timing:
    method: str  # "cuda-graph" or "cpu-host-clock"
    layers: int
    working_set_bytes: int
    stock_us: list[float] = field(default_factory=list)  # per layer, one entry per sample
    candidate_us: list[float] = field(default_factory=list)
    capture_index: list[int] = field(default_factory=list)  # which capture each pair used
    stop_reason: str = ""
    watched: int = 0  # timed candidate replays compared with its eager result (all of them)
    input_sets: int = 0  # the input sets the timed pairs ran on: a new one for every pair
    # Sampled calls whose start event may have fired before the host had queued the call, so
    # that their interval may hold the graph's launch (_cuda_intervals); of timed_calls. Only
    # once the spin has reached its longest: before that such a batch is not sampled
    # (late_batches) and the spin doubles; lead_cycles is the spin the run ended with.
    late_starts: int = 0
    timed_calls: int = 0
    late_batches: int = 0
    lead_cycles: int = 0
    watched_problems: list[str] = field(default_factory=list)  # why those disagreed


@dataclass
class PairInputs:
    """A new input set for every timed pair, doing the timed inputs' work (2026-12-07).

    A path that keeps a checksum of its inputs and, while it is unchanged, copies the result it
    kept passes every check on fixed inputs and is timed doing the copy. So before each pair
    the inputs a pair may change are drawn afresh and written in place, where both arms' graphs
    read them: the problem's `pair_inputs(case, seed, device)` where it has one (a subset, e.g.
    a decode layer's hidden state, the cache staying), else all of `make_inputs`. Where the
    problem counts its work (`floor_bytes`; one GPU's whole inputs, so not under decode CP),
    each layer's timed inputs are first set to a draw of the most common work among a few, and
    a pair's draw is kept only when it counts those bytes: the experts a MoE's routing
    activates decide its time, and every pair must time the same work. A draw is known by its
    seed alone and made again when needed, so a pair's inputs cost no memory while they wait."""

    draw: Callable[[int, int], Tensors]  # (layer, seed): the values a pair writes
    work: Callable[[int, Tensors], int] | None  # (layer, those values): the bytes they need
    wanted: list[int | None]  # each layer's bytes on the timed inputs (None: not counted)
    layer_set: LayerSet
    seed: int

    def seeds_for_batch(self, batch: int, pairs: int) -> list[list[int]]:
        """Each pair's seeds, one per layer, drawn before the batch (the work check
        synchronizes with the device, so it stays out of the enqueued replays)."""
        return [
            [self._seed_with_the_work(batch, pair, layer) for layer in range(len(self.wanted))]
            for pair in range(pairs)
        ]

    def _seed_with_the_work(self, batch: int, pair: int, layer: int) -> int:
        for attempt in range(MAX_INPUT_DRAWS):
            seed = derive_seed(self.seed, "pair inputs", batch, pair, layer, attempt)
            if self.work is None or self.work(layer, self.draw(layer, seed)) == self.wanted[layer]:
                return seed
        raise RuntimeError(
            f"none of {MAX_INPUT_DRAWS} input sets drawn for a timed pair needed layer {layer}'s "
            f"{self.wanted[layer]} bytes of the timed inputs (the problem's floor_bytes)"
        )

    def write(self, seeds: list[int]) -> None:
        """One pair's inputs, written into every layer's input tensors in place."""
        for layer, seed in enumerate(seeds):
            inputs = self.layer_set.args[layer][1]
            for name, value in self.draw(layer, seed).items():
                inputs[name].copy_(value)


MAX_INPUT_DRAWS = 1000  # the most common work of a MoE layer comes about one draw in ten


def pair_inputs(
    path: LoadedPath, case: Case, layer_set: LayerSet, seed: int, device: torch.device
) -> PairInputs:
    """The timed pairs' input sets for `layer_set`, whose inputs now hold the timed inputs."""
    problem = path.problem
    hook = getattr(problem, "pair_inputs", None)
    counts_work = case.cp == 1 and hasattr(problem, "floor_bytes")

    def draw(layer: int, draw_seed: int) -> Tensors:
        make = hook or problem.make_inputs
        values = make(case, draw_seed, device)
        held = layer_set.args[layer][1]
        for name, value in values.items():
            like = held.get(name)
            if like is None or value.shape != like.shape or value.dtype != like.dtype:
                raise TypeError(
                    f"{type(problem).__name__}'s pair inputs give '{name}' as "
                    f"{tuple(value.shape)} {value.dtype}, which the layer's inputs do not hold"
                )
        return dict(values)

    draw(0, seed)  # a problem whose draws the layers cannot hold says so before any timing
    if not counts_work:
        return PairInputs(draw, None, [None] * len(layer_set.args), layer_set, seed)
    work = _work_counter(problem, case, layer_set)
    anchors = [_most_common_work(draw, work, seed, layer) for layer in range(len(layer_set.args))]
    inputs = PairInputs(draw, work, [needed for _, needed in anchors], layer_set, seed)
    inputs.write([anchor for anchor, _ in anchors])  # the timed work, and bytes_moved's inputs
    return inputs


ANCHOR_DRAWS = 32


def _most_common_work(
    draw: Callable[[int, int], Tensors], work: Callable[[int, Tensors], int], seed: int, layer: int
) -> tuple[int, int]:
    """(seed, bytes): a draw whose work is the most common among ANCHOR_DRAWS draws. The timed
    work is anchored there, not on one draw's: a draw whose routing activated a rare number of
    experts (one in a thousand) left no pair able to match it (an H100 quick validate,
    2026-12-07)."""
    seeds = [derive_seed(seed, "anchor", layer, n) for n in range(ANCHOR_DRAWS)]
    needs = [work(layer, draw(layer, anchor)) for anchor in seeds]
    common = max(sorted(set(needs)), key=needs.count)
    return seeds[needs.index(common)], common


def _work_counter(
    problem: object, case: Case, layer_set: LayerSet
) -> Callable[[int, Tensors], int]:
    """(layer, values) -> the problem's floor bytes of that layer with `values` written in: by
    its `floor_counter(case, weights, inputs)` where it has one (made for many draws on one
    layer, e.g. a captured graph), else one floor_bytes call per draw."""
    counter = getattr(problem, "floor_counter", None)
    if counter is not None:
        counters = [counter(case, weights, inputs) for weights, inputs, _ in layer_set.args]
        return lambda layer, values: int(counters[layer](values))
    floor = problem.floor_bytes  # type: ignore[attr-defined]

    def work(layer: int, values: Tensors) -> int:
        weights, inputs, _ = layer_set.args[layer]
        return int(floor(case, weights, {**inputs, **values}))

    return work


@dataclass
class WatchedReplays:
    """Holds the timed replays themselves to account (2026-12-06 review, 2026-12-07). Every
    timed call of either arm starts on outputs poisoned with NaN, outside its events, so a
    capture that does its work only when its outputs look checked does it in every timed call.
    Every pair runs on inputs of its own (`inputs`), so no timed call meets inputs the
    candidate has seen. After every timed candidate call its outputs are copied, outside the
    events; once the batch has synchronized, each pair's inputs are written again and the
    candidate's eager call on them (made after the timed one: made before, it would let a
    cache fill) is the yardstick for that copy, by the rule of the replay check
    (_first_disagreement). An eager call made after could still be served what the timed one
    kept (its inputs and a cheap result stashed on the device, looked up by content), so one
    pair per batch, picked where the candidate cannot see (`picked`), is also held to the stock
    path's timed result on the same inputs: the cosine floor and size outside the near-tie
    rows. `check`: what is demanded, in words."""

    poison: Callable[[], None]
    inputs: PairInputs
    # On the inputs the layers hold now: the candidate's eager call, and from it the judge of
    # a copied replay's outputs (why they are wrong; None when they are right).
    yardstick: Callable[[], Callable[[list[Tensors]], str | None]]
    # On the inputs the layers hold now: the judge of (candidate copy, stock copy).
    against_stock: Callable[[], Callable[[list[Tensors], list[Tensors]], str | None]]
    outputs: list[Tensors]
    check: str
    copied: dict[int, list[Tensors]] = field(default_factory=dict)
    picked: int = 0  # the pair whose stock result is copied too
    stock_copied: list[Tensors] | None = None

    def copy(self, pair: int) -> None:
        self.copied[pair] = self._outputs_now()

    def copy_stock(self, pair: int) -> None:
        if pair == self.picked:
            self.stock_copied = self._outputs_now()

    def _outputs_now(self) -> list[Tensors]:
        require_plain_tensors(*self.outputs, when="before a timed replay's outputs were copied")
        return [{n: t.clone() for n, t in outputs.items()} for outputs in self.outputs]

    def disagreements(self, seeds: list[list[int]]) -> tuple[list[str], str | None]:
        """Why each of the batch's copied replays is wrong, in pair order (empty: all right),
        and why the picked one disagrees with the stock path (None: it agrees). Every pair's
        eager call runs before any is judged: on N ranks they are collectives."""
        copied, self.copied = self.copied, {}
        stock, self.stock_copied = self.stock_copied, None
        judges = []
        for pair, pair_seeds in enumerate(seeds):
            self.inputs.write(pair_seeds)
            judges.append(self.yardstick())
            if pair == self.picked:
                stock_judge = self.against_stock()
        problems = [
            judge(copied[pair]) if pair in copied else "was never copied"
            for pair, judge in enumerate(judges)
        ]
        if stock is None or self.picked not in copied:
            against_stock: str | None = "was never copied"
        else:
            against_stock = stock_judge(copied[self.picked], stock)
        return [problem for problem in problems if problem], against_stock


def layers_for(bytes_per_layer: int, device: torch.device, max_layers: int) -> int:
    """Enough layers to exceed twice the L2 cache, within max_layers."""
    l2_bytes = l2_cache_bytes(device)
    return max(2, min(max_layers, math.ceil(2 * l2_bytes / max(bytes_per_layer, 1))))


def l2_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return 32 * 2**20


@dataclass(frozen=True)
class RankSync:
    """How the ranks of a multi-GPU case keep their timed graphs in step (harness.evaluation.
    ranks); None for a case on one process.

    layers: the layer count every rank uses, from each one's own. A CP rank's cache slice, and
        so its bytes per layer, can differ from its peer's; graphs with different numbers of
        collectives would pair the wrong ones and hang.
    align: returns on every rank at about the same moment. Called before each measured block:
        a rank that starts early would otherwise count its wait for the late one in the first
        collective as its own time.
    rank_sum: the sum of an integer over all ranks, the one number every rank gets: from each
        rank's random draw, the pair every rank checks against the stock path (whose near-tie
        rows are found by collectives under decode CP); from each rank's late starts, whether
        every rank times the batch again."""

    layers: Callable[[int], int]
    align: Callable[[], None]
    rank_sum: Callable[[int], int] = field(default=lambda number: number)


def build_layers(
    path: LoadedPath,
    case: Case,
    secret_seed: int,
    device: torch.device,
    max_layers: int,
    sync: RankSync | None = None,
) -> LayerSet:
    """Distinct weights, inputs and outputs per layer; as many layers as exceed 2x L2 (on N
    ranks, the largest count any rank wants)."""
    args = [_layer_args(path, case, secret_seed, 0, device)]
    bytes_per_layer = _bytes(args[0])
    layers = layers_for(bytes_per_layer, device, max_layers)
    if sync is not None:
        layers = sync.layers(layers)
    args += [_layer_args(path, case, secret_seed, layer, device) for layer in range(1, layers)]
    return LayerSet(args, bytes_per_layer * layers)


def _layer_args(
    path: LoadedPath, case: Case, secret_seed: int, layer: int, device: torch.device
) -> tuple[Tensors, Tensors, Tensors]:
    seed = derive_seed(secret_seed, case.id, "timing-layer", layer)
    weights = layer_weights(path, case, secret_seed, layer, device)
    inputs = path.problem.make_inputs(case, derive_seed(seed, "inputs"), device)
    return weights, inputs, path.problem.make_outputs(case, device)


def layer_weights(
    path: LoadedPath, case: Case, secret_seed: int, layer: int, device: torch.device
) -> Tensors:
    """A timed layer's weights, made from its seed: again, whenever values the candidate never
    had in its hands are needed (the candidate's calls get the timed layers' own tensors)."""
    seed = derive_seed(secret_seed, case.id, "timing-layer", layer)
    return path.problem.make_weights(case, derive_seed(seed, "weights"), device)  # type: ignore[no-any-return]


def changed_weights(
    path: LoadedPath, case: Case, secret_seed: int, layer_set: LayerSet, device: torch.device
) -> list[str]:
    """The timed layers' weights that no longer hold their seeded values, each as "layer N
    name". Both arms read the same weight tensors, so a candidate that rewrote one while it was
    timed (the router's bias, sending the stock path's tokens to more experts) would slow the
    path it is measured against (2026-12-06 review). Made again one layer at a time: the memory
    of one more layer, not of a copy of them all."""
    changed = []
    for layer, (weights, _, _) in enumerate(layer_set.args):
        seeded = layer_weights(path, case, secret_seed, layer, device)
        for name, value in seeded.items():
            held = weights.get(name)
            if not isinstance(held, torch.Tensor) or not torch.equal(held, value):
                changed.append(f"layer {layer} {name}")
        del seeded
    return changed


def _bytes(args: tuple[Tensors, Tensors, Tensors]) -> int:
    return sum(t.numel() * t.element_size() for group in args for t in group.values())


def sample_interleaved(
    stock: list[Callable[[], None]],
    candidate: list[Callable[[], None]],
    layer_set: LayerSet,
    device: torch.device,
    stop: StopRule,
    seed: int,
    sync: RankSync | None = None,
    watched: WatchedReplays | None = None,
    lead_cycles: int = LEAD_CYCLES,
) -> Timing:
    """A B, B A, ... in batches, until the speedup CI is narrow enough or time runs out.

    stock and candidate hold one step runner per capture; batch k uses capture k % captures.
    The first batch of each capture warms up and is not sampled: on the H100 of 2026-12-06 the
    first ~10 ms of replays after the checks' set-up ran 5-12% slower (the GPU had idled while a
    graph was captured). On N ranks every batch starts aligned. `watched`: every pair on inputs
    of its own, and the timed replays checked (the warm-up's too).

    `lead_cycles`: the GPU's spin before each call's start event (_cuda_intervals; 0: none).
    A batch in which a call may have started before the host had queued it (on any rank) is
    not sampled, and the spin doubles for the batches after it, up to LEAD_DOUBLINGS times;
    from then on such batches are sampled and their late calls counted. A parameter, not the
    constant read as the batches run: its default is fixed when this module loads, where the
    candidate's code cannot change it unseen (integrity watches defaults).
    """
    method = "cuda-graph" if device.type == "cuda" else "cpu-host-clock"
    timing = Timing(method, len(layer_set.args), layer_set.working_set_bytes)
    longest_lead = lead_cycles << LEAD_DOUBLINGS
    started = time.perf_counter()
    pick = random.SystemRandom()  # os.urandom: no seed the candidate could know or set
    batch = 0
    while True:
        capture = batch % len(stock)
        if watched:
            seeds = watched.inputs.seeds_for_batch(batch, stop.pairs_per_batch)
            watched.picked = pick.randrange(stop.pairs_per_batch)
        if sync is not None:
            if watched:
                watched.picked = sync.rank_sum(watched.picked) % stop.pairs_per_batch
            sync.align()
        late: list[int] = []
        if watched:
            new_pairs = timed_pairs(
                stock[capture],
                candidate[capture],
                stop.pairs_per_batch,
                device,
                watched.poison,
                functools.partial(_write_pair, watched.inputs, seeds),
                watched.copy,
                watched.copy_stock,
                late,
                lead_cycles,
            )
            _judge_watched(timing, watched, seeds, batch, capture)
        else:
            new_pairs = timed_pairs(
                stock[capture],
                candidate[capture],
                stop.pairs_per_batch,
                device,
                late=late,
                lead_cycles=lead_cycles,
            )
        batch += 1
        if 0 < lead_cycles < longest_lead and _late_on_any_rank(late, device, sync):
            # its times may hold a graph's launch: timed again, the GPU spinning longer
            timing.late_batches += 1
            lead_cycles *= 2
            continue
        if batch <= len(stock):
            continue  # a warm-up batch
        timing.late_starts += sum(late)
        timing.timed_calls += 2 * len(new_pairs)
        for stock_us, candidate_us in new_pairs:
            timing.stock_us.append(stock_us / timing.layers)
            timing.candidate_us.append(candidate_us / timing.layers)
            timing.capture_index.append(capture)
        pairs = len(timing.stock_us)
        if pairs < stop.min_pairs:
            continue  # the minimum comes first: fewer pairs give no usable interval
        if pairs >= stop.max_pairs:
            timing.stop_reason = f"reached {stop.max_pairs} sample pairs"
        elif time.perf_counter() - started > stop.max_seconds:
            timing.stop_reason = f"time cap of {stop.max_seconds:g} s after {pairs} pairs"
        else:
            point, low, high = speedup_ci95(timing.stock_us, timing.candidate_us, seed)
            if (high - low) / point < stop.ci_relative_width:
                timing.stop_reason = (
                    f"speedup CI narrower than {stop.ci_relative_width:.1%} after {pairs} pairs"
                )
        if timing.stop_reason:
            timing.lead_cycles = lead_cycles if device.type == "cuda" else 0
            return timing


def _late_on_any_rank(late: list[int], device: torch.device, sync: RankSync | None) -> bool:
    """Whether a call of the batch may have started late here or on a peer rank (the host
    clock has no such calls). Every rank asks at the same batches: their spins grow together."""
    if device.type != "cuda":
        return False
    return (sync.rank_sum(sum(late)) if sync is not None else sum(late)) > 0


def _write_pair(inputs: PairInputs, seeds: list[list[int]], pair: int) -> None:
    inputs.write(seeds[pair])


def _judge_watched(
    timing: Timing, watched: WatchedReplays, seeds: list[list[int]], batch: int, capture: int
) -> None:
    replays = len(seeds)
    timing.watched += replays
    timing.input_sets += replays
    wrong, against_stock = watched.disagreements(seeds)
    if not wrong and not against_stock:
        return
    if timing.watched_problems:  # the first one tells the story
        timing.watched_problems.append(f"batch {batch}")
        return
    where = f"(batch {batch}, capture {capture})"
    if wrong:
        problem = (
            f"{len(wrong)} of the {replays} timed replays of the candidate {where}, each on "
            f"inputs of its own, {watched.check}; the first {wrong[0]}"
        )
    else:  # right by its own eager calls, which may have been told what to answer
        problem = f"a timed replay of the candidate {where} {against_stock}"
    timing.watched_problems.append(
        f"{problem}: work done only when it is checked, or outputs cached"
    )


def poison_value(tensor: torch.Tensor) -> float | int | bool:
    """What an output is filled with before a call, so that a cell left unwritten shows: NaN
    for floating point, else the dtype's largest value (True for bool)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if tensor.dtype == torch.bool:
        return True
    return int(torch.iinfo(tensor.dtype).max)


def poison_outputs(layer_set: LayerSet) -> None:
    """Every layer's outputs filled with their poison (NaN for floats)."""
    for _, _, outputs in layer_set.args:
        for tensor in outputs.values():
            tensor.fill_(poison_value(tensor))


def output_poisoner(layer_set: LayerSet, device: torch.device) -> Callable[[], None]:
    """A call that runs poison_outputs, in one launch on CUDA."""
    return one_launch(lambda: poison_outputs(layer_set), device)


def size_tolerance(min_cosine: float) -> float:
    """The largest relative error that agrees with a cosine floor. A cosine sees directions
    only (a halved output has cosine 1): the size must agree as closely, sqrt(2 (1 - cosine))
    being the distance of two unit vectors at that cosine."""
    return math.sqrt(2 * (1 - min_cosine))


def one_launch(work: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """`work` as one captured graph on CUDA (a single launch between two timed replays), the
    plain call elsewhere."""
    if device.type != "cuda":
        return work
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph.replay


def watched_replays(
    candidate_fn: PathFn,
    layer_set: LayerSet,
    device: torch.device,
    min_cosine: float,
    exact: bool,
    inputs: PairInputs,
    problem: object = None,
) -> WatchedReplays:
    """The check of the timed replays, each against the candidate's eager result on its own
    pair's inputs."""
    poison = output_poisoner(layer_set, device)

    def yardstick() -> Callable[[list[Tensors]], str | None]:
        expected = _eager_outputs(candidate_fn, layer_set, device)
        keeps: list[dict[str, torch.Tensor]] = [{} for _ in layer_set.args]
        if not exact:  # the near-tie rows of these inputs (a float64 pass: not where unused)
            keeps = pooled_comparable_rows(problem, [(w, i) for w, i, _ in layer_set.args])
        return lambda copied: _first_disagreement(copied, expected, min_cosine, keeps, exact)

    def against_stock() -> Callable[[list[Tensors], list[Tensors]], str | None]:
        # uncapped: two correct paths may route a near-tie token differently, and with no
        # redraw here a capped rule would compare a batch-1 near tie in full
        pairs = [(w, i) for w, i, _ in layer_set.args]
        keeps = pooled_comparable_rows(problem, pairs, max_fraction=1.0)
        return lambda copied, stock: _first_disagreement(
            copied, stock, min_cosine, keeps, yardstick="the stock path's timed result"
        )

    check = (
        "gave other bits than its own eager result on the same inputs (the scope says the "
        "path is deterministic)"
        if exact
        else f"were not written, finite and as close to its own eager result on the same inputs "
        f"as a cosine of {min_cosine} and the same size demand"
    )
    outputs = [outputs for _, _, outputs in layer_set.args]
    return WatchedReplays(poison, inputs, yardstick, against_stock, outputs, check)


def step_runners(
    fn: PathFn, layer_set: LayerSet, device: torch.device, captures: int
) -> list[Callable[[], None]]:
    """No-argument calls that each run one step (all layers): graph replays on CUDA, one per
    capture; on CPU a single eager runner."""
    if device.type == "cuda":
        return [capture_graph(fn, layer_set).replay for _ in range(captures)]
    run_layers(fn, layer_set)  # warm up
    return [lambda: run_layers(fn, layer_set)]


def speedup_interval(timing: Timing, seed: int) -> tuple[float, tuple[float, float], float]:
    """(speedup, 95% CI, capture spread): the bootstrap interval of median(stock) /
    median(candidate), widened on each side by the two arms' capture spreads."""
    point, low, high = speedup_ci95(timing.stock_us, timing.candidate_us, seed)
    spread = capture_spread(timing.stock_us, timing.capture_index) + capture_spread(
        timing.candidate_us, timing.capture_index
    )
    return point, (low * (1 - spread), high * (1 + spread)), spread


def capture_spread(samples_us: list[float], capture_index: list[int]) -> float:
    """Relative range of the per-capture medians of one arm: 0 for a single capture."""
    medians = [
        median([s for s, c in zip(samples_us, capture_index, strict=True) if c == capture])
        for capture in sorted(set(capture_index))
    ]
    return (max(medians) - min(medians)) / median(samples_us)


def timed_pairs(
    a: Callable[[], None],
    b: Callable[[], None],
    count: int,
    device: torch.device,
    between: Callable[[], None] | None = None,
    before_pair: Callable[[int], None] | None = None,
    after_b: Callable[[int], None] | None = None,
    after_a: Callable[[int], None] | None = None,
    late: list[int] | None = None,
    lead_cycles: int = LEAD_CYCLES,
) -> list[tuple[float, float]]:
    """`count` (a_us, b_us) pairs, run strictly alternating; odd pairs run b first.

    Outside the timed intervals: `between` runs before every call (the engine poisons the
    outputs there), `before_pair(i)` before pair i's first call (the engine writes the pair's
    inputs there), `after_b(i)` and `after_a(i)` after pair i's b and a calls (the engine
    copies their outputs there). `late`, where given, receives the number of calls whose start
    may have fired before they were queued (_cuda_intervals, after a spin of `lead_cycles`; 0
    on the host clock)."""
    calls = []
    for i in range(count):
        calls += [a, b] if i % 2 == 0 else [b, a]
    before: dict[int, list[Callable[[], None]]] = {}
    after: dict[int, list[Callable[[], None]]] = {}
    for i in range(count):
        a_index, b_index = (2 * i, 2 * i + 1) if i % 2 == 0 else (2 * i + 1, 2 * i)
        if before_pair is not None:
            before[2 * i] = [functools.partial(before_pair, i)]
        if after_b is not None:
            after[b_index] = [functools.partial(after_b, i)]
        if after_a is not None:
            after[a_index] = [functools.partial(after_a, i)]
    if device.type == "cuda":
        times, late_calls = _cuda_intervals(calls, between or _nothing, before, after, lead_cycles)
    else:
        times, late_calls = _host_intervals(calls, between or _nothing, before, after)
    if late is not None:
        late.append(late_calls)
    pairs = []
    for i in range(count):
        first, second = times[2 * i], times[2 * i + 1]
        pairs.append((first, second) if i % 2 == 0 else (second, first))
    return pairs


def _nothing() -> None:
    return None


def _cuda_intervals(
    calls: list[Callable[[], None]],
    between: Callable[[], None],
    before: dict[int, list[Callable[[], None]]],
    after: dict[int, list[Callable[[], None]]],
    lead_cycles: int,
) -> tuple[list[float], int]:
    """Microseconds of each call between its own two CUDA events, all enqueued before one
    synchronize, and how many calls may have started late; `before[index]`, `between` and
    `after[index]` are enqueued outside the events.

    Just before each start event the GPU spins (`lead_cycles`), so the call is in the queue when
    the event fires. Without it, a GPU that had caught up with the host (which draws and writes
    each pair's inputs between the calls) recorded the start while the host was still
    launching the graph, and the interval took in that launch: on an H100 (2026-12-07) the
    stock's batch-1 samples ranged 151-228 µs per layer, the candidate's 89-122, and one
    capture of 4 x 1024 ran 16% slow.

    A call is counted as possibly late where the host took longer to queue it (from the lead
    event before the spin to the call's return) than the GPU took from the lead event to the
    start. Otherwise it cannot have started late: the GPU reached the lead event no earlier
    than the host queued it, so the start fired after the call was queued."""
    leads = [torch.cuda.Event(enable_timing=True) for _ in calls]
    starts = [torch.cuda.Event(enable_timing=True) for _ in calls]
    ends = [torch.cuda.Event(enable_timing=True) for _ in calls]
    queueing_ms = []
    torch.cuda._sleep(2_000_000)  # the GPU spins (~1 ms) while the host enqueues ahead of it
    for index, (call, lead, start, end) in enumerate(zip(calls, leads, starts, ends, strict=True)):
        for function in before.get(index, []):
            function()
        between()
        queued = time.perf_counter()  # before the lead event: the GPU reaches it after this
        lead.record()
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        call()
        end.record()
        queueing_ms.append(1000.0 * (time.perf_counter() - queued))
        for function in after.get(index, []):
            function()
    torch.cuda.synchronize()
    late = sum(
        host_ms > lead.elapsed_time(start)
        for host_ms, lead, start in zip(queueing_ms, leads, starts, strict=True)
    )
    return [1000.0 * start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)], late


def _host_intervals(
    calls: list[Callable[[], None]],
    between: Callable[[], None],
    before: dict[int, list[Callable[[], None]]],
    after: dict[int, list[Callable[[], None]]],
) -> tuple[list[float], int]:
    times = []
    for index, call in enumerate(calls):
        for function in before.get(index, []):
            function()
        between()
        started = time.perf_counter()
        call()
        times.append(1e6 * (time.perf_counter() - started))
        for function in after.get(index, []):
            function()
    return times, 0


def capture_graph(fn: PathFn, layer_set: LayerSet) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compilation, autotuning) outside the capture
        for _ in range(2):
            run_layers(fn, layer_set)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_layers(fn, layer_set)
    torch.cuda.synchronize()
    return graph


def run_layers(fn: PathFn, layer_set: LayerSet) -> None:
    for weights, inputs, outputs in layer_set.args:
        fn(dict(weights), dict(inputs), dict(outputs))
        require_plain_tensors(weights, inputs, outputs, when="after a timed layer's call")


def eager_us(fn: PathFn, layer_set: LayerSet, device: torch.device) -> float:
    """Median per-layer time of plain eager calls (launch overheads included)."""
    repeats = 5 if device.type == "cuda" else 2
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run_layers(fn, layer_set)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(1e6 * (time.perf_counter() - started) / len(layer_set.args))
    return median(samples)


def refresh_inputs(
    path: LoadedPath, case: Case, layer_set: LayerSet, seed: int, device: torch.device
) -> None:
    """New values in every layer's inputs, written in place so the captured graphs read them.

    Done before and after the timed replays: a path that cached its outputs by input identity or
    content, or whose capture holds no real work, returns stale outputs afterwards.
    """
    for layer, (_, inputs, _) in enumerate(layer_set.args):
        fresh = path.problem.make_inputs(case, derive_seed(seed, "refresh", layer), device)
        for name, tensor in inputs.items():
            tensor.copy_(fresh[name])


def replay_mismatches(
    candidate: list[Callable[[], None]],
    candidate_fn: PathFn,
    layer_set: LayerSet,
    device: torch.device,
    min_cosine: float,
    problem: object = None,
    exact: bool = False,
) -> list[str]:
    """Each candidate capture replayed into NaN-poisoned outputs, after the inputs were
    refreshed, against the candidate's own eager call on copies of the same inputs: every output
    written, finite, and as close to the eager result as correctness demands (cosine; the same
    bits where the scope says the path is deterministic). A capture that replays cached
    outputs, or holds only part of the work, disagrees with it.

    The candidate's own eager call is the yardstick, not the stock path: two paths that round
    differently may route a near-tie MoE token differently, which is not a stale output. Whether
    the eager result itself is still right after the timed runs is a correctness trial's
    question (engine.still_correct_after_timing, run after this). Rows the problem calls
    near-tie decisions are left out, capped over all the layers' rows together: no redraw is
    possible here.
    The first disagreement per capture is reported."""
    expected = _eager_outputs(candidate_fn, layer_set, device)
    keeps = pooled_comparable_rows(problem, [(w, i) for w, i, _ in layer_set.args])
    reasons = []
    for index, step in enumerate(candidate):
        got = _replayed_outputs(step, layer_set, device)
        problem_text = _first_disagreement(got, expected, min_cosine, keeps, exact)
        if problem_text:
            reasons.append(
                f"after the timed runs, on fresh inputs, capture {index} of the candidate "
                f"{problem_text}: outputs cached, or work left outside the timed step"
            )
    return reasons


def _eager_outputs(fn: PathFn, layer_set: LayerSet, device: torch.device) -> list[Tensors]:
    """One plain call per layer on copies of its inputs (other addresses, same values) into
    new NaN-filled outputs: a result cached by input address or content is not reused."""
    results = []
    for weights, inputs, outputs in layer_set.args:
        copies = {n: t.clone() for n, t in inputs.items()}
        fresh = {n: torch.full_like(t, poison_value(t)) for n, t in outputs.items()}
        fn(dict(weights), copies, dict(fresh))
        require_plain_tensors(weights, copies, fresh, when="after an eager call")
        results.append(fresh)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return results


def _replayed_outputs(
    step: Callable[[], None], layer_set: LayerSet, device: torch.device
) -> list[Tensors]:
    require_plain_tensors(*(o for _, _, o in layer_set.args), when="before the replay check")
    poison_outputs(layer_set)
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()  # device-wide: work on any stream has finished
    return [{n: t.clone() for n, t in outputs.items()} for _, _, outputs in layer_set.args]


def _first_disagreement(
    got: list[Tensors],
    expected: list[Tensors],
    min_cosine: float,
    keeps: list[dict[str, torch.Tensor]],
    exact: bool = False,
    yardstick: str = "its own eager result",
) -> str | None:
    """`exact`: the same bits (a deterministic path replays the kernels it ran eagerly, so a
    capture that computes something cheaper but close, weights requantized while it was
    captured, differs); else a cosine of at least min_cosine outside the near-tie rows."""
    for layer, (mine, theirs, keep) in enumerate(zip(got, expected, keeps, strict=True)):
        for name, value in mine.items():
            if not bool(value.isfinite().all()):
                return f"left layer {layer}'s '{name}' unwritten or non-finite"
            if exact:
                differ = int((value != theirs[name]).sum())
                if differ:
                    return (
                        f"gave layer {layer}'s '{name}' other bits than {yardstick} on the "
                        f"same inputs in {differ} of {value.numel()} elements (the scope "
                        "says the path is deterministic)"
                    )
                continue
            rows = keep.get(name)
            if rows is not None:
                value, reference = value[rows], theirs[name][rows]
            else:
                reference = theirs[name]
            cosine = cosine_similarity(value, reference.to(REFERENCE_DTYPE))
            if not cosine >= min_cosine:
                return (
                    f"gave layer {layer}'s '{name}' a cosine of {cosine:.4f} to {yardstick} on "
                    f"the same inputs (at least {min_cosine} needed)"
                )
            allowed = size_tolerance(min_cosine)
            error = relative_error(value, reference.to(REFERENCE_DTYPE))
            if not error <= allowed:
                return (
                    f"gave layer {layer}'s '{name}' a relative error of {error:.3g} to "
                    f"{yardstick} on the same inputs (at most {allowed:.3g}, as the cosine floor)"
                )
    return None


def wall_us_per_layer(
    step: Callable[[], None], layers: int, device: torch.device, repeats: int = 20
) -> float:
    """Replays between two device-wide synchronizations, by the host clock: independent of the
    CUDA events, and it sees work on every stream."""
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize(device)
    return 1e6 * (time.perf_counter() - started) / (repeats * layers)


# Cross-checks of the event timing. A kernel span this much longer than the events measured, or a
# wall-clock time this much longer (beyond the launch allowance), means work the events did not
# see: a side stream, a patched timer. Graph replays show neither (measured on the H200: span and
# events agree within 10%), so a flag sends the verdict to a reviewer rather than failing it.
SPAN_RATIO_LIMIT = 1.5
WALL_RATIO_LIMIT = 2.0
LAUNCH_ALLOWANCE_US = 50.0  # per replay: the host's graph launch, which events do not include


def cross_check_flags(event_us: float, wall_us: float, span_us: float, layers: int) -> list[str]:
    """Per-layer times of one path: event median, wall clock, profiled kernel span."""
    flags = []
    if span_us > SPAN_RATIO_LIMIT * event_us + 1.0:
        flags.append(
            f"profiled kernels spanned {span_us:.3g} us per layer but the events measured "
            f"{event_us:.3g} us: work outside the timed stream?"
        )
    if wall_us > WALL_RATIO_LIMIT * event_us + LAUNCH_ALLOWANCE_US / layers:
        flags.append(
            f"the wall clock (device-wide synchronization) measured {wall_us:.3g} us per layer "
            f"but the events {event_us:.3g} us: work outside the timed stream, or a patched timer?"
        )
    return flags
