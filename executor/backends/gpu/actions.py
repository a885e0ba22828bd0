"""The GPU fields of an HTTP API action (``gpus``, ``inputs``); executor/server/schemas.py
``ActionIn.to_action`` builds the Action itself, for every kind of action."""

from __future__ import annotations

from typing import Any

from tangram.model import Demand
from traces.schema import parse_set


def gpu_fields(body: Any) -> tuple[Demand, dict[str, Any]]:
    """The GPU counts and the payload of an ``ActionIn`` that names a ``service``;
    ValueError names the bad field."""
    try:
        gpus = parse_set(body.gpus)
    except ValueError as e:
        raise ValueError(f"gpus: not a feasible set ({e})") from None
    if gpus is None or any(c not in (1, 2, 4, 8) for c in gpus.choices):
        raise ValueError(f"gpus: GPU counts must be 1, 2, 4 or 8, got {body.gpus!r}")
    inputs = body.inputs
    if not isinstance(inputs, dict):
        raise ValueError("inputs: a GPU action needs {op: 'logprobs' | 'score', tokens: [[ids]]}")
    if inputs.get("op", "logprobs") not in ("logprobs", "score"):
        raise ValueError(f"inputs.op: expected 'logprobs' or 'score', got {inputs.get('op')!r}")
    tokens = inputs.get("tokens")
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(r, list) and r and all(isinstance(t, int) for t in r) for r in tokens):
        raise ValueError("inputs.tokens: expected a non-empty list of non-empty lists of token ids")
    if body.argv is not None or body.command is not None or body.request is not None:
        raise ValueError("service: a GPU action takes inputs, not argv/command/request")
    return gpus, {**inputs, "timeout_s": body.timeout_s}
