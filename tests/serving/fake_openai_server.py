"""A fake OpenAI-compatible completions server on a known token schedule, for the serving tests.

It stands in for `vllm serve` at the outside boundary: the tests start it as a separate process
(through harness/serving/launcher.py), drive load through real HTTP streams and read its
/metrics. Token i of a streamed response leaves at start + ttft + i * itl (an absolute schedule,
so delays do not accumulate). Outputs are a fixed function of the prompt, so two servers with the
same settings give the same greedy completions; `--perturb-mod` changes some of them.

Without `ignore_eos`, a response stops early at the first token id divisible by 13, like a model
meeting its end-of-sequence token: a client that forgets `ignore_eos` gets short outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

EOS_MODULUS = 13


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--crash-on-start", action="store_true")
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--http-500-every", type=int, default=0)
    parser.add_argument("--error-mid-stream-every", type=int, default=0)
    parser.add_argument("--die-after-tokens", type=int, default=0)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--perturb-mod", type=int, default=0)
    parser.add_argument("--speculative-config", default=None)
    parser.add_argument("--accepted-per-draft", type=int, default=0)
    parser.add_argument("--spawn-term-ignoring-child", action="store_true")
    return parser.parse_args(argv)


def token_ids(prompt: list[int], count: int) -> list[int]:
    seed = sum(prompt) * 31
    return [(seed + i * 7919) % 50000 + 100 for i in range(count)]


def perturbed(prompt: list[int], perturb_mod: int) -> bool:
    return bool(perturb_mod) and bool(prompt) and prompt[0] % perturb_mod == 0


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.completions = 0
        self.tokens_sent = 0
        self.active_streams = 0
        self.last_request: dict[str, Any] = {}
        self.registry = CollectorRegistry()
        self.spec_tokens = 0
        if args.speculative_config:
            self.spec_tokens = int(json.loads(args.speculative_config)["num_speculative_tokens"])
            self._spec_counters()

    def _spec_counters(self) -> None:
        labels = ["engine", "model_name"]
        names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        self.counters = {
            name: Counter(f"vllm:spec_decode_{name}", name, labels, registry=self.registry)
            for name in names
        }
        for engine in (0, 1):  # vLLM creates each engine's children up front, at 0
            for counter in self.counters.values():
                counter.labels(str(engine), self.args.model)

    def count_draft(self, engine: int) -> None:
        if not self.spec_tokens:
            return
        labels = (str(engine), self.args.model)
        self.counters["num_drafts"].labels(*labels).inc()
        self.counters["num_draft_tokens"].labels(*labels).inc(self.spec_tokens)
        self.counters["num_accepted_tokens"].labels(*labels).inc(self.args.accepted_per_draft)

    def output_ids(self, body: dict[str, Any]) -> list[int]:
        ids = token_ids(body["prompt"], int(body["max_tokens"]))
        if not body.get("ignore_eos"):
            stops = [i for i, tok in enumerate(ids) if tok % EOS_MODULUS == 0]
            ids = ids[: stops[0] + 1] if stops else ids
        if perturbed(body["prompt"], self.args.perturb_mod):
            ids[len(ids) // 2] += 1  # one token differs mid-way: a near-tie flipped by numerics
        return ids

    def sent_token(self) -> None:
        self.tokens_sent += 1
        if self.args.die_after_tokens and self.tokens_sent >= self.args.die_after_tokens:
            print("fake server: dying mid-run (simulated crash)", flush=True)
            os._exit(1)


def chunk(model: str, text: str, ids: list[int] | None, finish: str | None) -> str:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    event = {"id": "cmpl-fake", "object": "text_completion", "model": model, "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n"


async def stream(fake: Fake, body: dict[str, Any], number: int) -> AsyncIterator[str]:
    args, start = fake.args, time.perf_counter()
    ids = fake.output_ids(body)
    fake.active_streams += 1
    try:
        for i, tok in enumerate(ids):
            due = start + (args.ttft_ms + i * args.itl_ms) / 1000
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if args.error_mid_stream_every and number % args.error_mid_stream_every == 0 and i == 2:
                error = {"error": {"message": "simulated engine failure", "code": 500}}
                yield f"data: {json.dumps(error)}\n\n"
                return
            finish = "length" if i == len(ids) - 1 else None
            fake.count_draft(number % 2)
            fake.sent_token()
            yield chunk(args.model, f" w{tok}", [tok], finish)
        if (body.get("stream_options") or {}).get("include_usage") and not args.no_usage:
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
            yield f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        fake.active_streams -= 1


def make_app(fake: Fake) -> Starlette:
    args = fake.args

    async def health(_: Request) -> Response:
        return Response(status_code=503 if args.never_healthy else 200)

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(generate_latest(fake.registry).decode())

    async def stats(_: Request) -> Response:
        return JSONResponse(
            {
                "completions": fake.completions,
                "active_streams": fake.active_streams,
                "last_request": fake.last_request,
            }
        )

    async def completions(request: Request) -> Response:
        body = await request.json()
        fake.completions += 1
        fake.last_request = body
        number = fake.completions
        if body.get("model") != args.model:
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)
        if args.http_500_every and number % args.http_500_every == 0:
            return JSONResponse({"error": {"message": "simulated 500"}}, status_code=500)
        if body.get("stream"):
            return StreamingResponse(stream(fake, body, number), media_type="text/event-stream")
        return JSONResponse(await whole(fake, body))

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/debug/stats", stats),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def whole(fake: Fake, body: dict[str, Any]) -> dict[str, Any]:
    ids = fake.output_ids(body)
    await asyncio.sleep((fake.args.ttft_ms + (len(ids) - 1) * fake.args.itl_ms) / 1000)
    choice: dict[str, Any] = {"index": 0, "text": "".join(f" w{t}" for t in ids)}
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
    return {"id": "cmpl-fake", "object": "text_completion", "choices": [choice], "usage": usage}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    marker = os.environ.get("PATHGATE_FAKE_MARKER")
    print(f"fake server: pid={os.getpid()} marker={marker}", flush=True)
    if args.crash_on_start:
        print("fake server: simulated startup failure: CUDA out of memory", flush=True)
        sys.exit(3)
    if args.spawn_term_ignoring_child:
        # a worker process that ignores SIGTERM, as a stuck engine worker would
        ignore = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", ignore])
        print(f"fake server: child pid={child.pid}", flush=True)
    config = uvicorn.Config(
        make_app(Fake(args)), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off"
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main(sys.argv[1:])
