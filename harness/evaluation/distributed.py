"""Run one case on N ranks: spawned processes, one process group, results back to the parent.

`run_on_ranks(fn, world_size, backend, timeout_s, args)` starts `world_size` processes with
torch.multiprocessing's spawn (never fork: a forked CUDA context is unusable), each of which
joins a process group through a FileStore in a fresh temporary folder (no port to pick, none to
collide with another run), calls `fn(rank, world_size, *args)` and sends its pickled return
value to the parent. On "nccl" rank r drives GPU r, with NVLink multicast (NVLS) turned off.

Outcomes are types: `RanksFinished` holds every rank's result (index = rank; `root` is rank 0's,
by convention the rank that gathers the others' outputs); `RankCrashed` names the first rank that
raised or died, with its traceback's tail; `RanksTimedOut` names the ranks that had not finished.
On a failure every rank is killed at once (a rank blocked in a collective whose peer is gone
would otherwise wait out the collective's own timeout), and so is every process a rank started:
nothing is left running. After success the ranks leave the group together.

Two clocks. Starting the ranks (interpreter, torch import, CUDA and NCCL initialization) is
bounded by `startup_timeout_s`; `timeout_s` bounds `fn` and starts once every rank has joined
the group, so a slow start on a loaded host is never blamed on the case.

Results travel by value (plain pickle): return CPU tensors and numbers; a CUDA tensor would
initialize CUDA in the parent. `fn` and `args` must be picklable, so `fn` is a module-level
function. A rank keeps its process group open after sending its result until every rank has
finished: a rank that left early would break a peer's pending collective into a crash, where
the peer is really waiting on a rank that never joined (a hang, reported as a timeout).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Backend = Literal["gloo", "nccl"]
ResultT = TypeVar("ResultT")

# Set in every NCCL rank before the group forms: NVLink SHARP multicast stays off on lent GPUs
# (KINDS.md of the device tool), for NCCL, torch's symmetric memory and NVSHMEM alike. The
# ranks share one host: NCCL's bootstrap goes over loopback (in an evaluation child's network
# namespace the only interface) and never looks for InfiniBand; its warnings reach the log.
NCCL_RANK_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
}
NCCL_RANK_ENV_DEFAULTS = {"NCCL_DEBUG": "WARN"}  # unless the user chose a level
STARTUP_TIMEOUT_S = 120.0
HARNESS_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this `harness`
EXIT_GRACE_S = 10.0  # after success: time for the ranks to leave the group before a kill
KILL_WAIT_S = 30.0
TRACEBACK_TAIL_CHARS = 4000
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class RanksFinished(Generic[ResultT]):
    results: tuple[ResultT, ...]  # rank r's return value at index r
    run_s: float  # as the parent saw it: from every rank having joined to the last result

    @property
    def root(self) -> ResultT:
        """Rank 0's result: by convention the rank that gathers the others' outputs."""
        return self.results[0]


@dataclass(frozen=True)
class RankCrashed:
    rank: int
    error: str  # the tail of the rank's traceback, or how its process ended
    # ranks that had also failed when this one was reported, most often in a collective the
    # first one left
    also_failed: tuple[int, ...] = ()


@dataclass(frozen=True)
class RanksTimedOut:
    ranks: tuple[int, ...]  # the ranks that had not finished (not joined, in "startup")
    after_s: float
    phase: Literal["startup", "run"]


RankFailure = RankCrashed | RanksTimedOut


def run_on_ranks(
    fn: Callable[..., ResultT],
    world_size: int,
    backend: Backend,
    timeout_s: float,
    args: Sequence[Any] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> RanksFinished[ResultT] | RankFailure:
    """fn(rank, world_size, *args) on `world_size` ranks of one process group; never raises for
    what a rank does. Returns once every rank has returned, one has failed, or time is up; in
    each case no rank or process a rank started is left running."""
    _check_request(world_size, backend, timeout_s)
    # the collectives' own timeout outlasts both of ours, so a hang is ours to report
    group_timeout_s = startup_timeout_s + timeout_s + 60.0
    with tempfile.TemporaryDirectory(prefix="pathgate-ranks-") as scratch:
        store = str(Path(scratch) / "store")
        launch = _Launch(backend, store, group_timeout_s, fn, tuple(args), tuple(sys.path))
        ranks = _start_ranks(launch, world_size)
        try:
            outcome = _collect(ranks, timeout_s, startup_timeout_s)
        except BaseException:  # the parent interrupted: still leave nothing running
            _stop(ranks, graceful=False)
            raise
        _stop(ranks, graceful=isinstance(outcome, RanksFinished))
        return outcome


def slowest_rank_us(per_rank_us: Sequence[Sequence[float]]) -> list[float]:
    """Per-sample time of a multi-rank step: sample i = the largest of the ranks' sample i.

    A context-parallel step ends when its slowest rank ends (the merge needs every partial),
    so one rank's own time understates the step and a mean over ranks hides a straggler. The
    ranks' samples must be aligned: sample i times the same step on every rank (each rank runs
    the same schedule, stock and candidate interleaved A B / B A, with the step's collective
    keeping them in lockstep), so applying this to each arm keeps stock/candidate pairs paired.
    """
    if not per_rank_us:
        raise ValueError("no ranks' samples to combine")
    lengths = {len(samples) for samples in per_rank_us}
    if len(lengths) != 1:
        raise ValueError(f"ranks took different numbers of samples: {sorted(lengths)}")
    return [max(step) for step in zip(*per_rank_us, strict=True)]


def _check_request(world_size: int, backend: Backend, timeout_s: float) -> None:
    if world_size < 1 or timeout_s <= 0:
        raise ValueError(f"need world_size >= 1 and timeout_s > 0, got {world_size}, {timeout_s}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"{world_size} NCCL ranks need {world_size} GPUs; {torch.cuda.device_count()} visible"
        )


# --- the ranks' side ---


@dataclass(frozen=True)
class _Launch:
    """What every rank receives (pickled into it by spawn)."""

    backend: Backend
    store_path: str
    group_timeout_s: float
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    sys_path: tuple[str, ...]  # the parent's, restored once the rank's harness is imported


def _rank_main(rank: int, world_size: int, launch: _Launch, conn: Connection, parent: int) -> None:
    """Messages to the parent: ("ready",), then ("result", pickled bytes) or ("error", when,
    traceback tail)."""
    # Spawn imported this harness from its own folder (_harness_first_on_path); the parent's
    # order comes back for what the rank imports next (a submission's `kernels`). The
    # harness's own modules stay this harness's: a package's submodules resolve through the
    # package, not sys.path.
    sys.path[:] = launch.sys_path
    _die_with_parent(parent)
    try:
        _join_group(rank, world_size, launch)
        conn.send(("ready",))
        result = launch.fn(rank, world_size, *launch.args)
        conn.send(("result", pickle.dumps(result)))
    except BaseException:  # a rank's every failure, SystemExit included, goes to the parent
        conn.send(("error", time.time(), traceback.format_exc()[-TRACEBACK_TAIL_CHARS:]))
        return
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # the parent closes its end once every rank has finished
    if launch.backend == "nccl":
        # Destroying a NCCL group whose collectives were captured in CUDA graphs can hang
        # (pytorch#115388); the result is delivered, so leave without tearing anything down.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)
    dist.destroy_process_group()


def _join_group(rank: int, world_size: int, launch: _Launch) -> None:
    device_id = None
    if launch.backend == "nccl":
        os.environ.update(NCCL_RANK_ENV)  # read by NCCL when the communicator is created
        for name, value in NCCL_RANK_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    dist.init_process_group(
        launch.backend,
        store=dist.FileStore(launch.store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=launch.group_timeout_s),
        device_id=device_id,
    )


def _die_with_parent(parent: int) -> None:
    """SIGKILL this rank when the parent dies, even by SIGKILL: a rank is never left holding a
    GPU or a peer's collective. Linux only; elsewhere the parent's cleanup is all there is."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


# --- the parent's side ---


@dataclass
class _Rank:
    index: int
    process: BaseProcess
    conn: Connection
    ready: bool = False
    payload: tuple[Any] | None = None  # (result,) once received
    failed_at: float | None = None
    error: str = ""
    reaped: bool = False  # its pid may belong to another process now: never signal it


@contextlib.contextmanager
def _harness_first_on_path() -> Iterator[None]:
    """Spawn gives a rank the parent's sys.path, and the rank imports `harness` (to unpickle its
    entry point) from the first entry that holds one. In an evaluation child the submitted
    checkout comes first (its `kernels` must win over the installed ones), so a `harness`
    package in it would replace this one in every rank: its own timing, its own verdict. While
    ranks start, the folder this harness came from goes first."""
    saved = sys.path[:]
    sys.path[:] = [HARNESS_ROOT, *(entry for entry in saved if entry != HARNESS_ROOT)]
    try:
        yield
    finally:
        sys.path[:] = saved


def _start_ranks(launch: _Launch, world_size: int) -> list[_Rank]:
    context = mp.get_context("spawn")
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=_rank_main,
                args=(rank, world_size, launch, theirs, os.getpid()),
                name=f"pathgate-rank-{rank}",
            )
            with _harness_first_on_path():
                process.start()
            theirs.close()  # only the rank holds its end now: its death reads as EOF here
            ranks.append(_Rank(rank, process, ours))
    except BaseException:  # e.g. `fn` cannot be pickled: the ranks already started go too
        _stop(ranks, graceful=False)
        raise
    return ranks


def _collect(
    ranks: list[_Rank], timeout_s: float, startup_timeout_s: float
) -> RanksFinished[Any] | RankFailure:
    phase_started = time.monotonic()
    deadline, phase = phase_started + startup_timeout_s, "startup"
    while True:
        failure = _first_failure(ranks)
        if failure is not None:
            return failure
        if phase == "startup" and all(r.ready for r in ranks):
            phase_started = time.monotonic()
            deadline, phase = phase_started + timeout_s, "run"
        if all(r.payload is not None for r in ranks):
            results = tuple(r.payload[0] for r in ranks if r.payload is not None)
            return RanksFinished(results, time.monotonic() - phase_started)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _timed_out(ranks, phase, time.monotonic() - phase_started)
        pending = [r for r in ranks if r.failed_at is None and r.payload is None]
        by_conn = {id(r.conn): r for r in pending}
        for conn in wait([r.conn for r in pending], remaining):
            _receive(by_conn[id(conn)])


def _receive(rank: _Rank) -> None:
    try:
        message = rank.conn.recv()
    except (EOFError, OSError):
        _mark_failed(rank, time.time(), _how_it_ended(rank))
        return
    match message:
        case ("ready",):
            rank.ready = True
        case ("result", bytes() as pickled):
            try:
                rank.payload = (pickle.loads(pickled),)
            except Exception as exc:  # e.g. a class the parent cannot import
                _mark_failed(rank, time.time(), f"its result could not be unpickled: {exc!r}")
        case ("error", float() as when, str() as text):
            _mark_failed(rank, when, text)


def _mark_failed(rank: _Rank, when: float, error: str) -> None:
    rank.failed_at, rank.error = when, error


def _how_it_ended(rank: _Rank) -> str:
    rank.process.join(5.0)  # its end of the pipe closes just before the process is gone
    code = rank.process.exitcode
    if code is None:
        return "closed its channel to the parent without a result"
    rank.reaped = True
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{how} before returning a result"


def _first_failure(ranks: list[_Rank]) -> RankCrashed | None:
    """The earliest failure: a rank that raises makes its peers' collectives fail after it."""
    failed = sorted((r for r in ranks if r.failed_at is not None), key=lambda r: r.failed_at or 0)
    if not failed:
        return None
    first = failed[0]
    others = tuple(sorted(r.index for r in failed[1:]))
    return RankCrashed(first.index, first.error, others)


def _timed_out(ranks: list[_Rank], phase: str, after_s: float) -> RanksTimedOut:
    if phase == "startup":
        waiting = tuple(r.index for r in ranks if not r.ready)
        return RanksTimedOut(waiting, after_s, "startup")
    return RanksTimedOut(tuple(r.index for r in ranks if r.payload is None), after_s, "run")


def _stop(ranks: list[_Rank], graceful: bool) -> None:
    """Release (after success) or kill every rank, then kill whatever the ranks started."""
    live = [r for r in ranks if not r.reaped and r.process.exitcode is None]
    started_by_ranks = _descendants(_pid(r) for r in live)
    if graceful:
        for rank in ranks:
            rank.conn.close()
        _join_all(live, EXIT_GRACE_S)
    # an unreaped rank's pid is still its own (a zombie at worst), so the signal cannot stray
    for pid in [_pid(r) for r in live if r.process.exitcode is None] + started_by_ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # bounded: a process stuck in the kernel (a hung GPU driver call) outlives even SIGKILL
    _join_all(ranks, KILL_WAIT_S)
    for rank in ranks:
        rank.conn.close()


def _pid(rank: _Rank) -> int:
    if rank.process.pid is None:
        raise RuntimeError(f"rank {rank.index} was never started")
    return rank.process.pid


def _join_all(ranks: list[_Rank], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for rank in ranks:
        rank.process.join(max(0.0, deadline - time.monotonic()))


def _descendants(roots: Iterable[int]) -> list[int]:
    """Every process below `roots`, from /proc (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name in parentheses may hold spaces: split after its last ")"
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found: list[int] = []
    frontier = list(roots)
    while frontier:
        below = [child for pid in frontier for child in children.get(pid, [])]
        found += below
        frontier = below
    return found
