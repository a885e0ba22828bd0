"""OpenAI-compatible endpoints over the GPU services: teachers and reward models
served from Tangram's GPU pool, each request one GPU action of the named service,
scheduled like every other action (evict-on-execution, batching).

* ``POST /v1/completions``: a teacher's prompt log-probs, as verl 0.9's distillation
  asks its teacher servers for them (verl.experimental.teacher_loop:
  ``{"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize":
  False}`` over the sequence's token ids). ``model`` is the service; ``prompt`` a
  list of token ids (or a list of such lists). The answer is vLLM's: per choice,
  ``prompt_logprobs`` is ``[None, {"<id>": {"logprob", "rank", "decoded_token"}},
  ...]`` (the first token has no prefix) and ``prompt_token_ids``. It is a
  ``teacher_logprob`` action (op ``logprobs``).
* ``POST /classify``: a reward model's score, vLLM's classify shape verl's reward
  loop reads (``data[-1].probs[-1]``); ``input`` a list of token ids (or lists).
  A ``reward_judge`` action (op ``score``).

What is not served, refused with a 422 that says so: text prompts (the services
take token ids: tokenize on the client, as verl does), generating tokens
(``max_tokens`` above 1: the GPU actions are forward passes) and top-k prompt
log-probs (``prompt_logprobs`` above 0: the services give each token's own).

Backpressure: a request the GPU pool would not serve within its timeout (``timeout_s``
in the body, at most and by default ``WAIT_S``) is answered at once with HTTP 429 and a
``Retry-After`` header (seconds), instead of holding the client until the timeout and
failing then. The estimate reads only what the server has seen: the GPU actions queued
and running (the core's snapshot) and the GPU-seconds each service's requests have
cost so far (:meth:`GpuBackend.gpu_s_per_request`); a service not served yet is not
refused.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from executor.server.routes.deps import owner, service
from executor.server.routes.gpus import gpu_backend
from executor.server.schemas import MIN_TIMEOUT_S, ActionIn, Name, TrajectoryIn
from executor.server.service import Refused, Service
from tangram.protocol import Snapshot

router = APIRouter()
Svc = Annotated[Service, Depends(service)]
Owner = Annotated[str, Depends(owner)]
#: the longest a request waits for its GPU action (queue + run)
WAIT_S = 600.0
Tokens = list[Annotated[int, Field(ge=0, le=2**31)]]


class CompletionIn(BaseModel):
    # clients send more OpenAI fields than are served: ignored, as OpenAI-compatible
    # servers do; the ones that change the answer are checked below
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Name = Field(description="The GPU service (e.g. a teacher).")
    prompt: Tokens | list[Tokens] | str = Field(description="Token ids, or a list of them.")
    max_tokens: int | None = Field(None, ge=0, description="0 or 1: a forward pass.")
    prompt_logprobs: int | None = Field(None, ge=0)
    temperature: float | None = None
    # (at least the shortest an action may ask for: a smaller one is a clear 422 at once,
    # not one from the action made after admission)
    timeout_s: float | None = Field(None, ge=MIN_TIMEOUT_S, le=WAIT_S, description=(
        "How long the client waits (default and most: 600 s); a request the pool would "
        "not serve in time is answered 429 with Retry-After at once."))


class ClassifyIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Name = Field(description="The GPU service (a reward model).")
    input: Tokens | list[Tokens] | str = Field(description="Token ids, or a list of them.")
    yes_token: int = Field(1, ge=0, description="The score: log-prob of this next token.")
    # (at least the shortest an action may ask for: a smaller one is a clear 422 at once,
    # not one from the action made after admission)
    timeout_s: float | None = Field(None, ge=MIN_TIMEOUT_S, le=WAIT_S, description=(
        "How long the client waits (default and most: 600 s); a request the pool would "
        "not serve in time is answered 429 with Retry-After at once."))


def _rows(value: Any, field: str, least: int) -> list[list[int]]:
    if isinstance(value, str):
        raise Refused(422, f"{field}: Tangram's GPU services take token ids, not text "
                           "(tokenize on the client, as verl does)")
    rows = value if value and isinstance(value[0], list) else [value]
    if not rows or any(len(r) < least for r in rows) or len(rows) > 256:
        raise Refused(422, f"{field}: expected 1 to 256 sequences of at least {least} token "
                           "id(s)")
    return rows


def expected_done_s(snap: Snapshot, gpu_s: Mapping[str, float], gpus: int,
                    service: str) -> float | None:
    """Seconds until a request of ``service`` submitted now would end, as far as the
    server can tell: the GPU-seconds of what is ahead of it (GPU actions queued and
    running; each at its service's observed GPU-seconds per request, a service not
    observed yet at the mean of those that were) spread over the pool's GPUs, then its
    own. A running action counts whole (its remaining time is not known), so the
    estimate errs late. None while ``service`` has not been observed: no guess."""
    if service not in gpu_s or gpus <= 0:
        return None
    mean = sum(gpu_s.values()) / len(gpu_s)
    ahead = [w.action.service for q in snap.queues if q.resource == "gpu" for w in q.waiting]
    ahead += [d.action.service for d in snap.running.values() if d.lease.gpus]
    work = sum(gpu_s.get(svc or "", mean) for svc in ahead)
    return work / gpus + gpu_s[service]


def _admit(s: Service, model: str, timeout_s: float) -> None:
    """Refuse with 429 + Retry-After a request the pool would not serve in ``timeout_s``."""
    gpu = gpu_backend(s.executor.backend)
    if gpu is None:
        return
    done = expected_done_s(s.executor.snapshot(), gpu.gpu_s_per_request(), gpu.gpu_count,
                           model)
    if done is None or done <= timeout_s:
        return
    # by then the work ahead has drained enough for a new request to end in time
    # (if nothing else arrives): the earliest a retry is worth making
    retry = max(1, math.ceil(done - timeout_s))
    raise HTTPException(429, f"{model}: the GPU pool would serve this request in about "
                             f"{done:.0f} s, past its {timeout_s:g} s timeout; retry after "
                             f"{retry} s", headers={"Retry-After": str(retry)})


async def _gpu_action(s: Service, who: str, model: str, kind: str, inputs: dict[str, Any],
                      timeout_s: float | None) -> Any:
    """One GPU action in a trajectory of its own (``who``'s: its token's), closed when it
    ends."""
    wait_s = timeout_s or WAIT_S
    _admit(s, model, wait_s)
    tid = s.open_trajectory(TrajectoryIn(task=model), owner=who)["id"]
    aid = f"{kind}-{secrets.token_hex(8)}"
    try:
        await s.submit(tid, ActionIn(id=aid, kind=kind, service=model, gpus="1",
                                     inputs=inputs, timeout_s=wait_s), who)
        out = await s.wait(aid, wait_s, who)
    finally:
        try:  # an action still in flight (a timeout, a client gone) is cancelled
            await s.close_trajectory(tid, owner=who)
        except Refused:  # shutting down: the server fails it
            pass
    if out.status != "ok":
        bad_input = out.error.startswith("payload.")
        raise Refused(422 if bad_input else 503,
                      f"{model}: the GPU action ended {out.status}: {out.error or 'no detail'}")
    return json.loads(out.output)


@router.post("/v1/completions")
async def completions(body: CompletionIn, s: Svc, who: Owner) -> dict[str, Any]:
    """Prompt log-probs of a teacher (vLLM's completion shape with ``prompt_logprobs``)."""
    rows = _rows(body.prompt, "prompt", 2)
    if body.max_tokens is not None and body.max_tokens > 1:
        raise Refused(422, "max_tokens: at most 1 (a forward pass; generation is not served)")
    if body.prompt_logprobs is not None and body.prompt_logprobs > 0:
        raise Refused(422, "prompt_logprobs: 0 (each prompt token's own log-prob) or null; "
                           "top-k is not served")
    res = await _gpu_action(s, who, body.model, "teacher_logprob", {"op": "logprobs", "tokens": rows},
                            body.timeout_s)
    choices = []
    for i, (row, lps) in enumerate(zip(rows, res["logprobs"], strict=True)):
        prompt_lps: list[dict[str, Any] | None] = [None]
        prompt_lps += [{str(tok): {"logprob": lp, "rank": None, "decoded_token": None}}
                       for tok, lp in zip(row[1:], lps, strict=True)]
        choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                        "prompt_token_ids": row,
                        "prompt_logprobs": prompt_lps if body.prompt_logprobs is not None
                        else None})
    n = sum(len(r) for r in rows)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
            "created": int(time.time()), "model": body.model, "choices": choices,
            "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}}


@router.post("/classify")
async def classify(body: ClassifyIn, s: Svc, who: Owner) -> dict[str, Any]:
    """A reward model's score per sequence (vLLM's classify shape)."""
    rows = _rows(body.input, "input", 1)
    res = await _gpu_action(s, who, body.model, "reward_judge",
                            {"op": "score", "tokens": rows, "yes_token": body.yes_token},
                            body.timeout_s)
    return {"id": f"classify-{secrets.token_hex(12)}", "object": "list",
            "created": int(time.time()), "model": body.model,
            "data": [{"index": i, "label": None, "probs": [score], "num_classes": 1}
                     for i, score in enumerate(res["scores"])]}
