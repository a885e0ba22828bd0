"""Who admits API calls, a part of a policy (tangram/policies.py): the core's quota manager
(:class:`TangramAdmits`) or the provider, answering 429 past its quota
(:class:`ProviderAdmits`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from tangram.api.quota import QuotaManager
from tangram.cluster import QuotaSpec


class ProviderLimit(Protocol):
    """A provider's own quota, as a simulator models it (it answers 429 past it)."""

    def reserve(self, action_id: str, demands: Mapping[str, float], now: float) -> Any: ...

    def release(self, lease: Any) -> None: ...

    def next_expiry(self, now: float) -> float | None: ...


@dataclass(frozen=True)
class TangramAdmits:
    """The quota manager holds API calls until the quota has room."""

    name: ClassVar[str] = "tangram"

    def core_quotas(self, quotas: tuple[QuotaSpec, ...]) -> tuple[QuotaSpec, ...]:
        return quotas

    def provider(self, quotas: tuple[QuotaSpec, ...]) -> ProviderLimit | None:
        """The provider's limit a simulator models (None: we never exceed it)."""
        return None


@dataclass(frozen=True)
class ProviderAdmits:
    """Every call is sent at once; the provider answers 429 past its quota and the caller
    retries (tangram/api/backoff.py)."""

    name: ClassVar[str] = "provider"

    def core_quotas(self, quotas: tuple[QuotaSpec, ...]) -> tuple[QuotaSpec, ...]:
        # quotas are the provider's to enforce (with 429s), not ours: admit every call
        return tuple(replace(q, mode="concurrency", limit=float("inf")) for q in quotas)

    def provider(self, quotas: tuple[QuotaSpec, ...]) -> ProviderLimit | None:
        return QuotaManager(quotas)
