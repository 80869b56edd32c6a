"""The `pathgate` command line."""

from __future__ import annotations

import json
import secrets
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from harness.config import get_settings
from harness.evaluation.environment import DeviceUnavailable
from harness.evaluation.evidence import Evidence, evidence_json_schema
from harness.evaluation.plan import MAX_SEED
from harness.reports import facts
from harness.serving.cli import app as serving_app
from scopes.manifest import ManifestError, ScopeManifest, load_manifest_file

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3, "NEEDS_REVIEW": 4}
EXIT_USAGE = 2
TOKEN_NAME_MAX = 100  # ApiToken.name's column
EXIT_NO_VERDICT = 5  # the run stopped before a verdict: an internal error
EXIT_INTERRUPTED = 130
VERDICT_STYLE = {
    "PASS": "bold green",
    "FAIL": "bold red",
    "NEEDS_REVIEW": "bold magenta",
    "INCONCLUSIVE": "bold yellow",
}

app = typer.Typer(
    help="pathgate: validation gate for specialized inference paths.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Markup off: paths, names and server messages print as given (a file named "a[/x].yaml" once
# crashed rich's markup parser); colour goes through Text, never through text we did not write.
# soft_wrap: a path broken over two lines cannot be copied.
console = Console(stderr=True, markup=False, soft_wrap=True)
out_console = Console(markup=False, soft_wrap=True)


def _error(message: str) -> None:
    console.print(Text.assemble(("error:", "red"), f" {message}"))


class DeviceChoice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@app.command()
def validate(
    scope: Annotated[Path, typer.Argument(help="scope manifest (scopes/NAME.yaml)")],
    device: Annotated[DeviceChoice, typer.Option(help="where to run")] = DeviceChoice.auto,
    out: Annotated[Path | None, typer.Option(help="folder for evidence.json and report.md")] = None,
    quick: Annotated[bool, typer.Option(help="fewer cases, trials and samples")] = False,
    seed: Annotated[
        int | None,
        typer.Option(min=0, max=MAX_SEED, help="reuse a run's seed to reproduce it"),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(min=1, help="only the cases of this GPU count (as a gpu.<kind>.xN job)"),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(help="finish an interrupted run from the checkpoint.json in --out"),
    ] = False,
) -> None:
    """Run the scope's plan: correctness, timing and claims, stock vs candidate; exit 0 on PASS,
    1 on FAIL, 3 on INCONCLUSIVE, 4 on NEEDS_REVIEW, 2 on a bad manifest or usage, 5 when the
    run stopped on an internal error. After every case the cases so far go to checkpoint.json
    in the output folder; `--resume` (with the same options) runs only the cases an
    interrupted run had not finished."""
    from harness.evaluation import checkpoint
    from harness.evaluation.engine import EngineOptions, evaluate
    from harness.reports.markdown import render_markdown

    manifest = _load_or_exit(scope)
    if gpus is not None and gpus not in manifest.hardware.gpus:
        counts = ", ".join(map(str, manifest.hardware.gpus))
        _error(f"--gpus {gpus}: the scope has no {gpus}-GPU cases (hardware.gpus: {counts})")
        raise typer.Exit(EXIT_USAGE)
    out_dir = out or get_settings().output_dir / manifest.name
    try:  # before any case runs: a finished case must have somewhere to go
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _error(f"cannot write the output folder {out_dir}: {exc.strerror or exc}")
        raise typer.Exit(EXIT_USAGE) from None
    checkpoint_path = out_dir / checkpoint.FILE_NAME
    try:
        earlier = checkpoint.read(checkpoint_path) if resume or checkpoint_path.exists() else None
    except checkpoint.ResumeRefused as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None
    if earlier is not None and not resume:
        _error(
            f"{checkpoint_path} holds an unfinished run: finish it with --resume, or delete the "
            "file to start over"
        )
        raise typer.Exit(EXIT_USAGE)
    if earlier is not None and seed is None:
        seed = earlier.seed  # the plan is a function of the seed: the same cases
    command_seed = seed if seed is not None else secrets.randbits(63)
    options = EngineOptions(
        device=device.value,
        quick=quick,
        seed=command_seed,
        gpus=gpus,
        scope_path=str(scope),
        checkpoint=checkpoint_path,
        resume=earlier,
    )
    try:
        with _progress() as progress:
            evidence = evaluate(manifest, options, progress)
    except (DeviceUnavailable, checkpoint.ResumeRefused) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        console.print(f"interrupted; {_saved(checkpoint_path)}")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:  # an internal error: say so, keep the traceback, lose no case
        log = out_dir / "error.log"
        out_dir.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        message = f"error: the run stopped: {type(exc).__name__}: {exc}"[:500]
        saved = _saved(checkpoint_path)
        console.print(f"{message} (traceback in {log}); {saved}")
        raise typer.Exit(EXIT_NO_VERDICT) from None
    _write(out_dir, evidence, render_markdown(evidence))
    checkpoint_path.unlink(missing_ok=True)  # the evidence holds every case now
    _print_summary(evidence, out_dir)
    raise typer.Exit(EXIT_CODES[evidence.verdict])


@app.command("check")
def check(scope: Annotated[Path, typer.Argument(help="scope manifest")]) -> None:
    """Validate a manifest without running anything (exit 0 valid, 2 invalid); warn of entry
    points whose modules cannot be found from here."""
    from harness.evaluation.checkpoint import module_found

    manifest = _load_or_exit(scope)
    out_console.print(f"{scope}: valid scope '{manifest.name}' ({len(manifest.claims)} claims)")
    for name in ("problem", "baseline", "candidate", "supports"):
        module = getattr(manifest.path, name).split(":")[0]
        if not module_found(module):  # found without importing: a package may be submitted code
            console.print(
                f"warning: path.{name}: no module {module!r} on this Python's path; validate "
                "here would crash every case (install the package, or run from where it imports)"
            )


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of evidence.json."""
    out_console.print_json(json.dumps(evidence_json_schema()))


db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


class Role(StrEnum):
    contributor = "contributor"
    maintainer = "maintainer"


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply migrations up to REVISION (default: the newest)."""
    from harness.store.migrate import upgrade

    upgrade(get_settings().database_url, revision)
    out_console.print(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()] = "base") -> None:
    """Revert migrations down to REVISION (default: an empty database)."""
    from harness.store.migrate import downgrade

    downgrade(get_settings().database_url, revision)
    out_console.print(f"database at {revision}")


@token_app.command("create")
def token_create(
    role: Annotated[Role, typer.Option(help="contributor or maintainer")],
    name: Annotated[str, typer.Option(help="who or what holds it (at most 100 characters)")],
) -> None:
    """Create an API token; the token is printed once, as the last word of the output."""
    from harness.store import repositories as repo

    if not 1 <= len(name) <= TOKEN_NAME_MAX:
        _error(f"--name takes 1 to {TOKEN_NAME_MAX} characters")
        raise typer.Exit(EXIT_USAGE)
    with _database_session() as session:
        token, plaintext = repo.create_token(session, name, role.value)
        repo.record_audit(session, "cli", "token.create", f"token:{token.id}", {"role": role.value})
    print(f"created {role.value} token {token.id} for {name}: {plaintext}")


@token_app.command("list")
def token_list() -> None:
    """List the API tokens (never their values): id, role, name, created, revoked."""
    from harness.store import repositories as repo

    with _database_session() as session:
        for token in repo.list_tokens(session):
            revoked = f"revoked {token.revoked_at:%Y-%m-%d %H:%M}" if token.revoked_at else "active"
            created = f"created {token.created_at:%Y-%m-%d %H:%M}"
            print("\t".join([str(token.id), token.role, token.name, created, revoked]))


@token_app.command("revoke")
def token_revoke(
    # ids are the database's 32-bit integers: a larger one is no token, not a driver error
    token_id: Annotated[
        int, typer.Argument(help="the id `token list` shows", min=1, max=2**31 - 1)
    ],
) -> None:
    """Revoke an API token: its requests and dashboard sessions are refused from now on."""
    from harness.store import repositories as repo

    with _database_session() as session:
        token = repo.revoke_token(session, token_id)
        if token is None:
            _error(f"no token {token_id}")
            raise typer.Exit(EXIT_USAGE)
        repo.record_audit(session, "cli", "token.revoke", f"token:{token.id}", {})
    out_console.print(f"revoked token {token_id} ({token.name})")


@contextmanager
def _database_session() -> Iterator[Session]:
    """A unit of work for a CLI command; a database that is missing its tables, or cannot be
    reached, ends the command with a message (exit 2) rather than a traceback."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from harness.store.db import session_scope

    try:
        with session_scope() as session:
            yield session
    except (OperationalError, ProgrammingError) as exc:
        _error(
            f"the database at {get_settings().database_url} is not ready "
            f"({type(exc.orig).__name__}): run `pathgate db upgrade` (or `pathgate serve`, "
            "which does), and check that its server is up"
        )
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def worker(
    queues: Annotated[str | None, typer.Option(help="comma-separated; default: detected")] = None,
) -> None:
    """Run a Celery worker consuming the queues this machine's hardware can serve."""
    from workers.run import CannotIsolate, run_worker

    try:
        run_worker(queues.split(",") if queues else None)
    except CannotIsolate as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def serve(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    embedded_worker: Annotated[bool, typer.Option(help="also run a worker here")] = True,
) -> None:
    """Run the API, with an embedded worker by default (SQLite and an embedded broker need no
    server)."""
    from workers.run import CannotListen, serve_all

    try:
        serve_all(host, port, embedded_worker)
    except CannotListen as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None


@app.command()
def submit(
    scope: Annotated[Path, typer.Argument(help="scope manifest")],
    server: Annotated[str, typer.Option(help="base URL of a pathgate service")],
    token: Annotated[str, typer.Option(help="API token")],
    git_url: Annotated[str | None, typer.Option(help="source repository (else in-tree)")] = None,
    git_sha: Annotated[str | None, typer.Option(help="commit SHA (40 hex)")] = None,
    wait: Annotated[bool, typer.Option(help="wait for the verdict")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 3600.0,
) -> None:
    """Submit a scope to a pathgate service; with --wait, exit like `validate` on its verdict."""
    from harness.client import ServiceError, submit_and_wait

    if (git_url is None) != (git_sha is None):  # else the in-tree code would run unasked
        _error("--git-url and --git-sha go together")
        raise typer.Exit(EXIT_USAGE)
    # before submitting: with NaN or <= 0 the job would be queued and left unwatched
    if wait and not timeout > 0:
        _error(f"--timeout must be a positive number of seconds, not {timeout}")
        raise typer.Exit(EXIT_USAGE)
    _load_or_exit(scope)
    try:
        final = submit_and_wait(
            server, token, scope.read_text(), git_url, git_sha, wait, timeout, out_console.print
        )
    except ServiceError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None
    # errored or timed out: no verdict, exit 1 like a FAIL; waiting for hardware: 3
    codes = {**EXIT_CODES, "waiting_for_hardware": EXIT_CODES["INCONCLUSIVE"]}
    raise typer.Exit(codes.get(final, 1) if wait else 0)


def _load_or_exit(scope: Path) -> ScopeManifest:
    try:
        return load_manifest_file(scope)
    except ManifestError as exc:
        console.print(Text(f"{scope}: invalid scope manifest", style="red"))
        for problem in exc.problems:
            console.print(f"  {problem}")
        raise typer.Exit(EXIT_USAGE) from None


def _saved(checkpoint_path: Path) -> str:
    """What an interrupted run left, and how to finish it."""
    from harness.evaluation import checkpoint

    try:
        cases = len(checkpoint.read(checkpoint_path).cases)
    except checkpoint.ResumeRefused:
        return "no case was finished"
    where = f"{cases} finished case(s) are in {checkpoint_path}"
    return f"{where}: the same command with --resume runs the rest"


@contextmanager
def _progress() -> Iterator[Callable[[int, int, str], None]]:
    """A progress callback: a live bar on a terminal; elsewhere (a log, a remote job) one
    plain line per step, since a bar that is never drawn leaves a long run silent."""
    if not console.is_terminal:
        started = time.perf_counter()

        def log(done: int, total: int, label: str) -> None:
            elapsed = time.perf_counter() - started
            console.print(f"[{done}/{total}] {elapsed:.0f} s  {label}")

        yield log
        return
    description = TextColumn("{task.description}", style="bold")
    columns = (description, BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda done, total, label: bar.update(
            task, completed=done, total=total, description=label
        )


def _write(out_dir: Path, evidence: Evidence, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "evidence.json").write_text(evidence.model_dump_json(indent=2))
    (out_dir / "report.md").write_text(markdown)


def _print_summary(evidence: Evidence, out_dir: Path) -> None:
    style = VERDICT_STYLE[evidence.verdict]
    out_console.print(Text.assemble((evidence.verdict, style), f": {evidence.scope}"))
    for reason in evidence.verdict_reasons[:10]:
        out_console.print(f"  - {reason}")
    out_console.print(_cases_table(evidence))
    for note in evidence.notes + [f"ran nothing for: {n}" for n in evidence.not_run]:
        out_console.print(f"note: {note}")
    out_console.print(f"evidence: {out_dir / 'evidence.json'}  report: {out_dir / 'report.md'}")
    out_console.print(Text(evidence.verdict, style=style))


def _cases_table(evidence: Evidence) -> Table:
    table = Table(title=f"{evidence.scope} on {evidence.environment.get('host_gpu')}")
    for column in (
        "case",
        "correctness",
        "stock µs",
        "candidate µs",
        "speedup (95% CI)",
        "kernels per layer (stock / candidate)",
    ):
        table.add_column(column)
    for case in evidence.cases:
        perf = case.performance
        if perf is None:
            table.add_row(case.id, case.status, "-", "-", "-", "-")
            continue
        table.add_row(
            case.id,
            case.status,
            f"{perf.stock_us_median:.2f}",
            f"{perf.candidate_us_median:.2f}",
            facts.speedup_with_ci(perf),
            facts.kernel_pair(perf),
        )
    return table


github_app = typer.Typer(help="GitHub commit statuses (docs/github.md).", no_args_is_help=True)
app.add_typer(github_app, name="github")
app.add_typer(serving_app, name="serving")  # engine-level A/B and vLLM imports (docs/serving.md)


@github_app.command("sync")
def github_sync() -> None:
    """Post again the commit statuses whose posting failed, and verdicts never posted; exit 1
    if some still fail."""
    from harness.github.client import GitHubError, get_client
    from harness.github.statuses import resync

    try:
        result = resync(get_client(get_settings()))
    except GitHubError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None
    out_console.print(f"posted {result.posted} status(es); {result.failed} still failing")
    raise typer.Exit(1 if result.failed else 0)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
