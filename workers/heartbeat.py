"""While a worker runs: beat every `worker_heartbeat_s` (so the API knows which queues are
served) and sweep lost or unserved jobs. Started by Celery's worker_ready signal."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from celery.signals import worker_ready, worker_shutdown

from harness.config import get_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    queues: list[str]
    hardware: str  # e.g. "H200x1" or "cpu"
    main_pid: int  # the worker's main process (pool processes fork from it)


identity: Identity | None = None  # set by `pathgate worker` before the worker starts
_stop = threading.Event()


@worker_ready.connect
def _start(sender: object, **_: object) -> None:
    name = getattr(sender, "hostname", None) or "worker"
    if identity is None:
        return
    thread = threading.Thread(target=_loop, args=(name, identity), daemon=True, name="heartbeat")
    thread.start()


@worker_shutdown.connect
def _shutdown(**_: object) -> None:
    _stop.set()


def _loop(name: str, me: Identity) -> None:
    from workers.tasks import heartbeat, sweep_jobs

    interval = get_settings().worker_heartbeat_s
    while not _stop.is_set():
        try:
            heartbeat(name, me.queues, me.hardware)
            sweep_jobs()
        except Exception:  # the database may be briefly away; try again next beat
            log.exception("heartbeat or sweep failed")
        _stop.wait(interval)
