"""The Celery app. Broker from Settings: an embedded SQLite-backed broker by default, Redis in
deployment. Long GPU jobs: late acks, one message prefetched, one job at a time per worker."""

from __future__ import annotations

from celery import Celery

from harness.config import Settings, get_settings
from workers.workspace import CHECKOUT_MAX_S


def make_celery(settings: Settings) -> Celery:
    app = Celery(
        "pathgate",
        broker=settings.broker_url,
        include=["workers.tasks", "workers.heartbeat", "harness.github.tasks"],
    )
    app.conf.update(
        task_acks_late=True,  # a worker that dies mid-job leaves its message for another
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,  # one GPU job at a time
        task_ignore_result=True,  # results live in the database, not a result backend
        task_default_queue="cpu",
        task_soft_time_limit=task_time_limit_s(settings) - 120,
        task_time_limit=task_time_limit_s(settings),
        broker_transport_options=_transport_options(settings),
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return app


def task_time_limit_s(settings: Settings) -> float:
    """Celery's hard limit on a task: the longest checkout, the child's own wall-clock limit,
    and 4 minutes to store the result. The child is killed at its limit first."""
    return CHECKOUT_MAX_S + settings.job_timeout_s + 240


def _transport_options(settings: Settings) -> dict[str, float]:
    if settings.broker_url.startswith(("redis://", "rediss://")):
        # far above the hard limit, so a slow job is never handed to a second worker meanwhile
        return {"visibility_timeout": 2 * settings.job_timeout_s + 3600}
    return {}  # the embedded SQL transport passes its options to create_engine


app = make_celery(get_settings())


def enqueue(job_id: int, queue: str) -> None:
    app.send_task("pathgate.run_job", args=[job_id], queue=queue)
