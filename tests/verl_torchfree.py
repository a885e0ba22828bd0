"""Import verl's tool modules in a process without torch.

verl is installed with ``pip install --no-deps verl`` (the Makefile's install
step; its full dependency set is torch, vLLM, ... many GB). Its tool modules
need only pydantic, omegaconf, ray and transformers (all in the dev extras,
transformers without torch), but two package ``__init__`` files on the way
import torch eagerly: ``verl/__init__.py`` (``verl.protocol``) and
``verl/utils/__init__.py``. So we register those two packages in
``sys.modules`` as plain package objects whose ``__path__`` is the installed
directory, without running their ``__init__``; every module below them
(``verl.tools.base_tool``, ``verl.tools.schemas``, ``verl.tools.tool_registry``,
``verl.utils.rollout_trace``, ...) is then imported for real, from verl's files.
Nothing of verl is copied. With torch installed, verl is imported normally.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


def _bare_package(name: str, search: list[str] | None) -> types.ModuleType:
    spec = importlib.machinery.PathFinder.find_spec(name, search)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not installed (make installs it: pip install --no-deps verl)")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__file__ = spec.origin
    module.__package__ = name
    module.__spec__ = spec
    sys.modules[name] = module
    return module


def load_verl_tools() -> types.ModuleType:
    """``verl.tools.tool_registry`` (and thereby BaseTool and the schemas)."""
    if "verl" not in sys.modules and importlib.util.find_spec("torch") is None:
        verl = _bare_package("verl", None)
        utils = _bare_package("verl.utils", verl.__path__)
        verl.utils = utils  # type: ignore[attr-defined]
    return importlib.import_module("verl.tools.tool_registry")
