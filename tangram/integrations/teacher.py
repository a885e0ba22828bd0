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

verl 0.9.1 has no config key for an external teacher: it builds its clients from
its own teacher servers (``MultiTeacherModelManager.get_client``). To use
Tangram's, hand verl these clients where it takes ``teacher_client`` (a
``dict[str, LLMServerClient]`` keyed by each teacher's ``key``, the samples'
``data_source``), e.g. ``teacher_clients({"openai/gsm8k": "teacher0"})``;
``examples/verl_mopd.yaml`` shows the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class TeacherOutput:
    """The fields of verl's ``TokenOutput`` a teacher answer fills."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


class TangramTeacherClient:
    """``generate`` as verl's ``LLMServerClient`` has it, against one Tangram service."""

    def __init__(self, service: str, base_url: str | None = None, token: str | None = None,
                 timeout_s: float = 660.0) -> None:
        base_url = base_url or os.environ.get("TANGRAM_URL")
        if not base_url:
            raise ValueError("base_url: missing (or set TANGRAM_URL)")
        self.service = service
        self.base_url = base_url.rstrip("/")
        self.token = token or os.environ.get("TANGRAM_TOKEN")
        self.timeout_s = timeout_s

    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TeacherOutput:
        """The prompt log-probs of ``prompt_ids`` (``sampling_params`` as verl sends them;
        image/video/audio inputs are not served)."""
        if any(kwargs.get(k) for k in ("image_data", "video_data", "audio_data")):
            raise ValueError("multi-modal inputs: Tangram's teachers take token ids only")
        num = sampling_params.get("prompt_logprobs")
        body = {"model": self.service, "prompt": [int(t) for t in prompt_ids],
                **{k: v for k, v in sampling_params.items() if k != "detokenize"}}
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                     timeout=self.timeout_s) as http:
            resp = await http.post("/v1/completions", json=body)
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


def teacher_clients(services: dict[str, str], base_url: str | None = None,
                    token: str | None = None) -> dict[str, TangramTeacherClient]:
    """verl's ``teacher_client`` mapping: teacher key -> a client of that Tangram service."""
    return {key: TangramTeacherClient(svc, base_url, token) for key, svc in services.items()}
