"""A submission's report: its combined verdict, and each job's evidence and Markdown."""

from __future__ import annotations

import html
from typing import Any

from markupsafe import Markup
from sqlalchemy.orm import Session

from harness.evaluation.evidence import Evidence
from harness.reports.facts import SourceInfo
from harness.reports.html import render_report_section, render_sections_page
from harness.reports.markdown import inline_text
from harness.store import repositories as repo
from harness.store.models import Submission
from harness.submissions import manifest_file_name


def combined_report(session: Session, submission: Submission) -> dict[str, Any]:
    jobs = repo.jobs_of(session, submission.id)
    reports = {r.job_id: r for r in repo.reports_of(session, [j.id for j in jobs])}
    return {
        "submission": submission.id,
        "scope": submission.scope,
        "state": submission.state,
        "verdict": submission.verdict,
        "verdict_reasons": submission.verdict_reasons,
        "source": {
            "kind": submission.source_kind,
            "url": submission.source_url,
            "sha": submission.source_sha,
        },
        "jobs": [
            {
                "id": job.id,
                "queue": job.queue,
                "state": job.state,
                "reason": job.reason,
                "attempts": job.attempts,
                "evidence": reports[job.id].evidence if job.id in reports else None,
                "markdown": reports[job.id].markdown if job.id in reports else None,
            }
            for job in jobs
        ],
        "serving_results": [
            {
                "id": result.id,
                "kind": result.kind,
                "source_name": result.source_name,
                "sha256": result.sha256,
                "attached_by": result.attached_by,
                "attached_at": result.created_at.isoformat(timespec="seconds"),
                "data": result.data,
            }
            for result in repo.serving_results_of(session, submission.id)
        ],
    }


def serving_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(what, value, provenance key) of an attached result's rows that name a pathgate metric,
    vLLM's own rows first, then those derived here from its per-request lists."""
    data = result["data"]
    rows = []
    for origin, entries in (("", data.get("rows", [])), (" (derived)", data.get("derived", []))):
        for row in entries:
            if row.get("metric") is None:
                continue
            what = row["metric"] + (f" {row['statistic']}" if row.get("statistic") else "")
            rows.append((what + origin, f"{row['value']:.4g} {row['unit']}", row["key"]))
    return rows


def serving_provenance(result: dict[str, Any]) -> str:
    p = result["data"].get("provenance", {})
    return (
        f"{result['source_name']} (sha256 {result['sha256'][:16]}…): {p.get('backend')} serving "
        f"{p.get('model_id')}, {p.get('num_prompts')} prompts, max concurrency "
        f"{p.get('max_concurrency')}, request rate {p.get('request_rate')}, run {p.get('date')}; "
        f"attached by {result['attached_by']} at {result['attached_at']}"
    )


def render_combined_markdown(report: dict[str, Any]) -> str:
    verdict = report["verdict"] or report["state"]
    lines = [f"# Submission {report['submission']}: {report['scope']}: **{verdict}**", ""]
    # reasons and a job's reason can carry a candidate's exception text: escaped as the job
    # reports escape it
    lines += [f"- {inline_text(reason)}" for reason in report["verdict_reasons"]] + [""]
    lines += [_how_to_reproduce(report), ""]
    for job in report["jobs"]:
        lines += [f"## Job {job['id']} on `{job['queue']}`: {job['state']}", ""]
        if job["reason"] and not job["markdown"]:
            lines += [inline_text(job["reason"]), ""]
        if job["markdown"]:
            body = job["markdown"].split("\n", 1)[1] if "\n" in job["markdown"] else ""
            lines += [body.replace("\n## ", "\n### "), ""]
    lines += _serving_markdown(report["serving_results"])
    return "\n".join(lines)


def _serving_markdown(results: list[dict[str, Any]]) -> list[str]:
    if not results:
        return []
    lines = ["## Serving results (attached `vllm bench serve` files)", ""]
    for result in results:
        lines += [f"- {inline_text(serving_provenance(result))}", ""]
        lines += ["  | metric | value | vLLM key |", "  |---|---|---|"]
        lines += [
            f"  | {inline_text(w)} | {inline_text(v)} | `{inline_text(k)}` |"
            for w, v, k in serving_rows(result)
        ]
        lines += [""]
    return lines


def render_combined_html(report: dict[str, Any]) -> str:
    """The submission's summary, then each job's HTML report (tables and plots) from its evidence;
    a job without evidence shows its state and reason. Everything is escaped (templates)."""
    source = report["source"]
    info = SourceInfo(source["kind"], source["url"], source["sha"])
    verdict = report["verdict"] or report["state"]
    sections = [_summary_html(report, verdict)]
    for job in report["jobs"]:
        heading = f"<h2>Job {job['id']} on <code>{html.escape(job['queue'])}</code>: "
        heading += f"{html.escape(job['state'])}</h2>"
        if job["evidence"] is not None:
            evidence = Evidence.model_validate(job["evidence"])
            sections.append(Markup(heading) + render_report_section(evidence, info))
        else:
            reason = f"<p>{html.escape(job['reason'])}</p>" if job["reason"] else ""
            sections.append(Markup(heading + reason))
    if report["serving_results"]:
        sections.append(_serving_html(report["serving_results"]))
    title = f"pathgate: submission {report['submission']}: {verdict}"
    return render_sections_page(title, sections)


def _serving_html(results: list[dict[str, Any]]) -> Markup:
    parts = ["<h2>Serving results (attached <code>vllm bench serve</code> files)</h2>"]
    for result in results:
        parts.append(f"<p>{html.escape(serving_provenance(result))}</p>")
        rows = "".join(
            f"<tr><td>{html.escape(w)}</td><td class='num'>{html.escape(v)}</td>"
            f"<td><code>{html.escape(k)}</code></td></tr>"
            for w, v, k in serving_rows(result)
        )
        parts.append(
            f"<table><tr><th>metric</th><th>value</th><th>vLLM key</th></tr>{rows}</table>"
        )
    return Markup("".join(parts))


def _summary_html(report: dict[str, Any], verdict: str) -> Markup:
    reasons = "".join(f"<li>{html.escape(r)}</li>" for r in report["verdict_reasons"])
    return Markup(
        f"<h1>Submission {report['submission']}: {html.escape(report['scope'])}: "
        f"<span class='verdict verdict-{html.escape(verdict)}'>{html.escape(verdict)}</span></h1>"
        f"<ul>{reasons}</ul><p>{html.escape(_how_to_reproduce(report).replace('`', ''))}</p>"
    )


def _how_to_reproduce(report: dict[str, Any]) -> str:
    """A job's reproduce command names the submitted manifest's file, not a file of this tree
    (a contributor's manifest need not be one), and runs in the submitted source."""
    source, submission = report["source"], report["submission"]
    manifest = (
        f"save the submitted manifest (`GET /v1/submissions/{submission}/manifest.yaml`) as "
        f"`{manifest_file_name(submission)}` and run a job's reproduce command"
    )
    if source["kind"] == "git":
        where = f"Source: `{source['url']}` at `{source['sha']}`. To reproduce: check it out,"
        return f"{where} {manifest} from its root."
    return f"Source: in-tree (this pathgate checkout). To reproduce: {manifest}."
