"""The `pathgate` command line."""

from __future__ import annotations

import json
import shlex
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.config import get_settings
from harness.evaluation.environment import DeviceUnavailable
from harness.evaluation.evidence import Evidence
from scopes.manifest import ManifestError, ScopeManifest, load_manifest_file

EXIT_CODES = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}
EXIT_USAGE = 2
VERDICT_STYLE = {"PASS": "bold green", "FAIL": "bold red", "INCONCLUSIVE": "bold yellow"}

app = typer.Typer(
    help="pathgate: validation gate for specialized inference paths.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out_console = Console()


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
    seed: Annotated[int | None, typer.Option(help="reuse a run's seed to reproduce it")] = None,
) -> None:
    """Run the scope's plan: correctness, timing and claims, stock vs candidate; exit 0 on PASS,
    1 on FAIL, 3 on INCONCLUSIVE, 2 on a bad manifest or usage."""
    from harness.evaluation.engine import EngineOptions, evaluate
    from harness.reports.markdown import render_markdown

    manifest = _load_or_exit(scope)
    out_dir = out or get_settings().output_dir / manifest.name
    options = EngineOptions(device=device.value, quick=quick, seed=seed)
    try:
        with _progress() as progress:
            task = progress.add_task("starting", total=None)

            def report(done: int, total: int, label: str) -> None:
                progress.update(task, completed=done, total=total, description=label)

            evidence = evaluate(manifest, options, report)
    except DeviceUnavailable as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    evidence.run.command = _reproduce_command(scope, device.value, quick, evidence.run.seed)
    _write(out_dir, evidence, render_markdown(evidence))
    _print_summary(evidence, out_dir)
    raise typer.Exit(EXIT_CODES[evidence.verdict])


@app.command("check")
def check(scope: Annotated[Path, typer.Argument(help="scope manifest")]) -> None:
    """Validate a manifest without running anything (exit 0 valid, 2 invalid)."""
    manifest = _load_or_exit(scope)
    out_console.print(f"{scope}: valid scope '{manifest.name}' ({len(manifest.claims)} claims)")


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of evidence.json."""
    out_console.print_json(json.dumps(Evidence.model_json_schema()))


def _load_or_exit(scope: Path) -> ScopeManifest:
    try:
        return load_manifest_file(scope)
    except ManifestError as exc:
        console.print(f"[red]{scope}: invalid scope manifest[/red]")
        for problem in exc.problems:
            console.print(f"  {problem}", markup=False)
        raise typer.Exit(EXIT_USAGE) from None


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _reproduce_command(scope: Path, device: str, quick: bool, seed: int) -> str:
    parts = ["pathgate", "validate", str(scope), "--device", device, "--seed", str(seed)]
    return shlex.join(parts + (["--quick"] if quick else []))


def _write(out_dir: Path, evidence: Evidence, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "evidence.json").write_text(evidence.model_dump_json(indent=2))
    (out_dir / "report.md").write_text(markdown)


def _print_summary(evidence: Evidence, out_dir: Path) -> None:
    style = VERDICT_STYLE[evidence.verdict]
    out_console.print(f"[{style}]{evidence.verdict}[/{style}]: {evidence.scope}")
    for reason in evidence.verdict_reasons[:10]:
        out_console.print(f"  - {reason}", markup=False)
    out_console.print(_cases_table(evidence))
    for note in evidence.notes + [f"ran nothing for: {n}" for n in evidence.not_run]:
        out_console.print(f"note: {note}", markup=False)
    out_console.print(f"evidence: {out_dir / 'evidence.json'}  report: {out_dir / 'report.md'}")
    out_console.print(f"[{style}]{evidence.verdict}[/{style}]")


def _cases_table(evidence: Evidence) -> Table:
    table = Table(title=f"{evidence.scope} on {evidence.environment.get('host_gpu')}")
    for column in (
        "case",
        "correctness",
        "stock µs",
        "candidate µs",
        "speedup (95% CI)",
        "kernels",
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
            f"{perf.speedup:.3f} [{perf.speedup_ci95[0]:.3f}, {perf.speedup_ci95[1]:.3f}]",
            _kernels(
                perf.stock_kernels_per_layer, perf.candidate_kernels_per_layer, perf.kernel_source
            ),
        )
    return table


def _kernels(stock: float | None, candidate: float | None, source: str | None) -> str:
    if stock is None or candidate is None:
        return "-"
    return f"{stock:g} / {candidate:g}" + (" ops" if source == "cpu-ops" else "")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
