"""verl teachers served by Tangram: a client with the call verl's distillation makes.

verl 0.9's multi-teacher distillation (``verl.experimental.teacher_loop``) asks
each teacher, through an ``LLMServerClient``, for the prompt log-probs of a
sequence::

    out = await client.generate(request_id=..., prompt_ids=ids, sampling_params={
        "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False})
    out.extra_fields["prompt_ids"], out.extra_fields["prompt_logprobs"]  # len(ids) rows

:class:`TangramTeacherClient` answers that call from a Tangram server: it posts
the request to ``/v1/completions`` (OpenAI-compatible, vLLM's ``prompt_logprobs``
extension; executor/server/routes/openai.py), where it becomes a ``teacher_logprob`` GPU
action of the named service, scheduled with every other action. The rows follow
verl's vLLM server (``extract_prompt_logprobs``): row ``i`` holds the id and
log-prob of token ``i + 1`` given its prefix, the last row is padding (``[0]``,
``[0.0]``).

A teacher the server's GPU pool would not serve within the request's timeout is
answered HTTP 429 with ``Retry-After`` at once (executor/server/routes/openai.py);
``generate`` waits that long and asks again, logging each refusal, for at most
``retry_s`` in all (then it raises with the server's reason).

verl 0.9.1 has no config key for an external teacher: it builds its clients from
its own teacher servers (``MultiTeacherModelManager.get_client``). To use
Tangram's, hand verl these clients where it takes ``teacher_client`` (a
``dict[str, LLMServerClient]`` keyed by each teacher's ``key``, the samples'
``data_source``), e.g. ``teacher_clients({"openai/gsm8k": "teacher0"})``;
``examples/verl_mopd.yaml`` shows the rest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("tangram.teacher")


@dataclass
class TeacherOutput:
    """The fields of verl's ``TokenOutput`` a teacher answer fills."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class TangramTeacherClient:
    """``generate`` as verl's ``LLMServerClient`` has it, against one Tangram service."""

    def __init__(self, service: str, base_url: str | None = None, token: str | None = None,
                 timeout_s: float = 660.0, retry_s: float = 3600.0,
                 wait_s: float | None = None) -> None:
        base_url = base_url or os.environ.get("TANGRAM_URL")
        if not base_url:
            raise ValueError("base_url: missing (or set TANGRAM_URL)")
        self.service = service
        self.base_url = base_url.rstrip("/")
        self.token = token or os.environ.get("TANGRAM_TOKEN")
        self.timeout_s = timeout_s
        #: how long ``generate`` keeps asking again after 429s (busy pool) before it raises
        self.retry_s = retry_s
        #: the longest the server may take to serve one request (None: its own 600 s); one
        #: it would not serve in time is refused at once (429), then asked again
        self.wait_s = wait_s

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TeacherOutput:
        """The prompt log-probs of ``prompt_ids`` (``sampling_params`` as verl sends them;
        image/video/audio inputs are not served)."""
        if any(kwargs.get(k) for k in ("image_data", "video_data", "audio_data")):
            raise ValueError("multi-modal inputs: Tangram's teachers take token ids only")
        num = sampling_params.get("prompt_logprobs")
        body = {"model": self.service, "prompt": [int(t) for t in prompt_ids],
                **{k: v for k, v in sampling_params.items() if k != "detokenize"}}
        if self.wait_s is not None:
            body["timeout_s"] = self.wait_s
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        give_up = time.monotonic() + self.retry_s
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                     timeout=self.timeout_s) as http:
            while True:
                resp = await http.post("/v1/completions", json=body)
                wait = _retry_after(resp)
                if wait is None or time.monotonic() + wait > give_up:
                    break
                log.warning("teacher %s: HTTP 429 (%s); asking again in %g s", self.service,
                            resp.json().get("detail", ""), wait)
                await asyncio.sleep(wait)
        if resp.status_code != 200:
            raise RuntimeError(f"teacher {self.service}: HTTP {resp.status_code}: {resp.text[:500]}")
        choice = resp.json()["choices"][0]
        extra: dict[str, Any] = {}
        if num is not None:
            ids, lps = [], []
            for entry in choice["prompt_logprobs"][1:]:  # the first token has no prefix
                (tok, lp), = entry.items()
                ids.append([int(tok)])
                lps.append([float(lp["logprob"])])
            ids.append([0])  # verl's vLLM server pads the last prompt token the same way
            lps.append([0.0])
            extra = {"prompt_ids": ids, "prompt_logprobs": lps}
        return TeacherOutput(extra_fields=extra)


def _retry_after(resp: httpx.Response) -> float | None:
    """Seconds a 429 asks the client to wait (its ``Retry-After``; 1 if unreadable), or
    None for any other answer."""
    if resp.status_code != 429:
        return None
    try:
        return max(float(resp.headers.get("Retry-After", "1")), 0.0)
    except ValueError:  # an HTTP date: not what Tangram sends
        return 1.0


def teacher_clients(services: dict[str, str], base_url: str | None = None,
                    token: str | None = None) -> dict[str, TangramTeacherClient]:
    """verl's ``teacher_client`` mapping: teacher key -> a client of that Tangram service."""
    return {key: TangramTeacherClient(svc, base_url, token) for key, svc in services.items()}
