"""`pathgate serving ...`: the engine-level A/B and the import of `vllm bench serve` results.

A typer sub-app; harness/cli.py registers it. Exit codes follow `pathgate validate`: 0 when every
serving claim is verified, 1 when one is refuted or an arm's server failed, 3 when a claim is
inconclusive or not measurable here, 2 on a bad manifest, file or usage, 130 when interrupted
(SIGINT or SIGTERM: the server is stopped and the runs finished so far are kept in serving.json).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.evaluation.plan import MAX_SEED
from harness.serving.ab import ABOptions, ABResult, run_ab, serve_params
from harness.serving.launcher import interrupts_deferred
from harness.serving.vllm_import import VllmResultError, import_vllm_result
from scopes.manifest import KNOWN_GPUS, ManifestError, ScopeManifest, load_manifest_file

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCONCLUSIVE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

app = typer.Typer(
    help="Engine-level A/B: the stock serving engine vs the specialized path.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, markup=False, soft_wrap=True)  # as harness/cli.py's


@app.command("ab")
def ab_command(
    scope: Annotated[Path, typer.Argument(help="scope manifest with an engine: section")],
    out: Annotated[Path, typer.Option(help="folder for serving.json and server logs")] = Path(
        "pathgate-out/serving"
    ),
    cp: Annotated[int | None, typer.Option(help="decode CP degree (default: the first)")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPU count (default: the first)")] = None,
    seed: Annotated[
        int, typer.Option(help="prompt seed, the same for both arms", min=0, max=MAX_SEED)
    ] = 0,
    host_gpu: Annotated[
        str | None, typer.Option(help="this host's GPU kind (default: from nvidia-smi)")
    ] = None,
) -> None:
    """Start the server for each arm, drive the scope's workloads and greedy prompts through it,
    compare the arms and judge the serving claims; writes OUT/serving.json."""
    manifest = _load_or_exit(scope)
    if manifest.engine is None:
        _usage_error(f"{scope}: the scope has no engine: section")
    _check_listed("--cp", cp, manifest.workload.context_parallel)
    _check_listed("--gpus", gpus, manifest.hardware.gpus)
    if host_gpu is not None and host_gpu not in KNOWN_GPUS:
        _usage_error(f"--host-gpu {host_gpu}: unknown GPU kind; known: {', '.join(KNOWN_GPUS)}")
    evidence = out / "serving.json"
    _check_writable(evidence)  # before any server starts: an A/B can take an hour
    options = ABOptions(
        out_dir=out,
        params=serve_params(manifest, cp, gpus),
        host_gpu=host_gpu or detect_gpu_kind(),
        seed=seed,
    )
    with _sigterm_as_interrupt():
        result = run_ab(manifest, options)
    with interrupts_deferred(reraise=False) as late:  # the evidence is written whole
        _print_result(result)
        _write_evidence(evidence, result)
    raise typer.Exit(EXIT_INTERRUPTED if late else exit_code(result))


def _write_evidence(evidence: Path, result: ABResult) -> None:
    text = json.dumps(result.to_json(), indent=2, allow_nan=False)
    try:
        evidence.write_text(text)
    except OSError as exc:
        typer.echo(text)  # the run's only record: not lost with the file
        _usage_error(f"cannot write {evidence}: {exc.strerror or exc}; the evidence is above")
    console.print(f"evidence: {evidence}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`timeout`, a job scheduler's stop) as Ctrl-C: the server still running is
    stopped, group and all, and the runs finished so far go to serving.json."""

    def interrupt(signum: int, frame: object) -> None:
        # as SIGINT, not a KeyboardInterrupt raised here: inside the load generator's event
        # loop asyncio.run's own SIGINT handler cancels the requests cleanly
        if callable(signal.getsignal(signal.SIGINT)):
            signal.raise_signal(signal.SIGINT)
        else:  # SIGINT ignored (a script's background job): nothing would take it
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _usage_error(message: str) -> NoReturn:
    console.print(Text(message, style="red"))
    raise typer.Exit(EXIT_USAGE)


def _check_listed(option: str, value: int | None, listed: list[int]) -> None:
    if value is not None and value not in listed:
        shown = ", ".join(map(str, listed))
        _usage_error(f"{option} {value}: not in the scope (it lists {shown})")


def _check_writable(evidence: Path) -> None:
    """The evidence file's folder exists (made here) and takes a new file in its place."""
    try:
        evidence.parent.mkdir(parents=True, exist_ok=True)
        if evidence.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        with tempfile.NamedTemporaryFile(dir=evidence.parent, prefix=".write-check-"):
            pass
    except OSError as exc:
        _usage_error(f"cannot write {evidence}: {exc.strerror or exc}")


@app.command("import-vllm")
def import_vllm_command(
    files: Annotated[list[Path], typer.Argument(help="`vllm bench serve --save-result` files")],
    out: Annotated[Path | None, typer.Option(help="write the rows here (default: stdout)")] = None,
    attach: Annotated[
        int | None, typer.Option(help="also attach each file to this submission on --server")
    ] = None,
    server: Annotated[str, typer.Option(envvar="PATHGATE_SERVER")] = "http://127.0.0.1:8000",
    token: Annotated[str, typer.Option(envvar="PATHGATE_TOKEN")] = "",
) -> None:
    """Import vLLM benchmark results as evidence rows with provenance (JSON); with --attach,
    store them with a submission, where its report shows them."""
    try:
        imported = [import_vllm_result(path).to_json() for path in files]
    except VllmResultError as exc:
        console.print(Text(str(exc), style="red"))
        raise typer.Exit(EXIT_USAGE) from None
    if attach is not None:
        _attach(files, attach, server, token)
    text = json.dumps(imported, indent=2, allow_nan=False)
    if out is None:
        typer.echo(text)
    else:
        try:
            out.write_text(text)
        except OSError as exc:
            console.print(Text(f"cannot write {out}: {exc.strerror or exc}", style="red"))
            raise typer.Exit(EXIT_USAGE) from None
        console.print(f"{len(imported)} result(s) written to {out}")


def _attach(files: list[Path], submission_id: int, server: str, token: str) -> None:
    from harness.client import ServiceError, attach_serving_result

    for path in files:
        # a file name that is not UTF-8 (kept by Python as surrogates) travels with U+FFFD
        name = os.fsencode(path.name).decode("utf-8", "replace")
        try:
            attach_serving_result(server, token, submission_id, name, path.read_bytes())
        except (ServiceError, OSError) as exc:
            console.print(Text(f"{name}: {exc}", style="red"))
            raise typer.Exit(EXIT_USAGE) from None
        console.print(f"{name}: attached to submission {submission_id}")


def _load_or_exit(scope: Path) -> ScopeManifest:
    try:
        return load_manifest_file(scope)
    except ManifestError as exc:
        console.print(Text(f"{scope}: invalid manifest", style="red"))
        console.print(str(exc))
        raise typer.Exit(EXIT_USAGE) from None


def detect_gpu_kind() -> str:
    """The host's GPU kind from nvidia-smi, without touching CUDA in this process (a context
    here would take GPU memory the server is about to claim); "cpu" without one."""
    from harness.evaluation.environment import gpu_kind

    if shutil.which("nvidia-smi") is None:
        return "cpu"
    query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        _usage_error("nvidia-smi did not answer in 30 s; pass --host-gpu")
    except OSError as exc:
        _usage_error(f"cannot run nvidia-smi: {exc.strerror or exc}; pass --host-gpu")
    if done.returncode != 0:
        # nvidia-smi prints its own errors on stdout
        said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines() or [""]
        _usage_error(f"nvidia-smi failed (exit {done.returncode}) {said[0]}; pass --host-gpu")
    names = done.stdout.decode(errors="replace").strip().splitlines()
    return gpu_kind(names[0]) if names else "cpu"


def exit_code(result: ABResult) -> int:
    if result.interrupted:
        return EXIT_INTERRUPTED
    statuses = {claim.status for claim in result.claims}
    if result.failures or "refuted" in statuses:
        return EXIT_FAIL
    if statuses & {"inconclusive", "not_measurable"}:
        return EXIT_INCONCLUSIVE
    return EXIT_PASS


def _print_result(result: ABResult) -> None:
    for failure in result.failures:
        console.print(Text(f"failed: {failure}", style="red"))
    table = Table("row", "tokens/s base", "tokens/s cand", "gain [95% CI]", "failed")
    for row in result.rows:
        tps = row.metrics["tokens_per_s"]
        gain = f"{tps.gain:.3f} [{tps.gain_ci95[0]:.3f}, {tps.gain_ci95[1]:.3f}]"
        failed = f"{row.failed_requests['baseline']}/{row.failed_requests['candidate']}"
        base, cand = f"{tps.baseline_median:.1f}", f"{tps.candidate_median:.1f}"
        table.add_row(row.id, base, cand, gain, failed)
    console.print(table)
    if result.accuracy is not None:
        greedy = result.accuracy.greedy
        console.print(
            f"greedy: exact match {greedy.exact_match_rate:.3f}, "
            f"{greedy.unit} match {greedy.token_match_rate:.3f}; "
            f"gsm8k: {result.accuracy.gsm8k_summary}"
        )
    for claim in result.claims:
        console.print(f"claim {claim.status}: {claim.description}: {claim.reason}")
