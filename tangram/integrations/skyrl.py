"""``tangram.integrations.skyrl`` is ``tangram_sdk.integrations.skyrl``: kept for existing
configs and imports, and will stay.

The SDK left the core's package: the adapters are ``tangram_sdk.integrations``.
This module makes the old name the same module object (``sys.modules``), so importing it
registers ``tangram-shell`` once, by the SDK's module; a loader that runs this file as a
fresh module of its own (verl's ``get_tool_class``) reads every name through
``__getattr__``.
"""

from __future__ import annotations

import sys
from typing import Any

import tangram_sdk.integrations.skyrl as _sdk


def __getattr__(name: str) -> Any:
    return getattr(_sdk, name)


def __dir__() -> list[str]:
    return dir(_sdk)


sys.modules[__name__] = _sdk
