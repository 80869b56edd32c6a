"""A submission's report: its combined verdict, and each job's evidence and Markdown."""

from __future__ import annotations

import html
from typing import Any

import markdown
from sqlalchemy.orm import Session

from harness.store import repositories as repo
from harness.store.models import Submission


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
    }


def render_combined_markdown(report: dict[str, Any]) -> str:
    verdict = report["verdict"] or report["state"]
    lines = [f"# Submission {report['submission']}: {report['scope']}: **{verdict}**", ""]
    lines += [f"- {reason}" for reason in report["verdict_reasons"]] + [""]
    source = report["source"]
    if source["kind"] == "git":
        lines += [
            f"Source: `{source['url']}` at `{source['sha']}` (check it out, then run the "
            "reproduce command from its root).",
            "",
        ]
    else:
        lines += ["Source: in-tree (this pathgate checkout).", ""]
    for job in report["jobs"]:
        lines += [f"## Job {job['id']} on `{job['queue']}`: {job['state']}", ""]
        if job["reason"] and not job["markdown"]:
            lines += [job["reason"], ""]
        if job["markdown"]:
            body = job["markdown"].split("\n", 1)[1] if "\n" in job["markdown"] else ""
            lines += [body.replace("\n## ", "\n### "), ""]
    return "\n".join(lines)


def render_combined_html(report: dict[str, Any]) -> str:
    # Evidence carries submitted text (exception messages, names): no raw HTML may pass through.
    source = render_combined_markdown(report).replace("<", "&lt;")
    body = markdown.markdown(source, extensions=["tables", "fenced_code"])
    title = html.escape(f"pathgate: submission {report['submission']}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:sans-serif;max-width:72rem;margin:2rem auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
        "</style></head><body>" + body + "</body></html>"
    )
