"""The GitHub webhook: POST /v1/github/webhook (docs/github.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from pydantic import BaseModel

from harness.api.deps import SessionDep
from harness.api.schemas import Problem, problem_responses
from harness.config import get_settings
from harness.github import webhooks


class WebhookAnswer(BaseModel):
    status: Literal["pong", "queued", "ignored", "duplicate"]
    detail: str


router = APIRouter(prefix="/v1", tags=["github"])
RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {"model": WebhookAnswer, "description": "a pull request's work was queued"},
    401: {
        "model": Problem,
        "description": "missing or wrong X-Hub-Signature-256, or no webhook secret configured",
    },
    **problem_responses(413, 422),
}


async def raw_body(request: Request) -> bytes:
    """The exact bytes GitHub signed (a parsed-and-reserialized body would not verify)."""
    return await request.body()


@router.post(
    "/github/webhook",
    response_model=WebhookAnswer,
    responses=RESPONSES,
)
def github_webhook(
    response: Response,
    session: SessionDep,
    body: Annotated[bytes, Depends(raw_body)],
    x_hub_signature_256: Annotated[str | None, Header()] = None,
    x_github_event: Annotated[str | None, Header()] = None,
    x_github_delivery: Annotated[str | None, Header()] = None,
) -> WebhookAnswer:
    """Verify the delivery's signature, record it once, and queue a pull_request's work: 202
    queued, 200 for ping, a redelivery (duplicate) or an event pathgate does not act on."""
    settings = get_settings()
    webhooks.verify_signature(settings.github_webhook_secret, body, x_hub_signature_256)
    answer = webhooks.receive(session, settings, x_github_event, x_github_delivery, body)
    response.status_code = answer.http_status
    return WebhookAnswer(status=answer.status, detail=answer.detail)
