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

``ToolAgentLoop`` itself imports torch and PIL at module level, so
``load_call_tool`` compiles its ``_call_tool`` method from verl's installed
source file, unmodified (found by its AST node), with the names that module
binds (``json``, ``logger``, ``FunctionTool``, ``ToolResponse``, ...) taken from
verl's own torch-free modules. Annotations are not evaluated (they name torch
types), which is the only difference from the loaded method.
"""

from __future__ import annotations
import __future__

import ast
import importlib.machinery
import importlib.util
import json
import logging
import sys
import types
from pathlib import Path
from typing import Any


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


def compile_function(relpath: str, name: str, namespace: dict[str, Any],
                     cls: str | None = None) -> Any:
    """Function ``name`` (a method of ``cls``) of verl's installed ``relpath`` (e.g.
    ``experimental/agent_loop/tool_agent_loop.py``), compiled from its source as it is,
    its annotations unevaluated, with ``namespace`` as its module globals."""
    load_verl_tools()
    spec = importlib.util.find_spec("verl.tools.base_tool")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.parent / relpath
    tree = ast.parse(path.read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
              and n.name == name)
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace = {"logger": logging.getLogger(str(path)), **namespace}
    exec(code, namespace)
    return namespace[name]


def load_call_tool() -> Any:
    """verl 0.9.1's ``ToolAgentLoop._call_tool``, compiled from its installed source."""
    load_verl_tools()
    function_tool = importlib.import_module("verl.tools.function_tool")
    schemas = importlib.import_module("verl.tools.schemas")
    return compile_function(
        "experimental/agent_loop/tool_agent_loop.py", "_call_tool",
        {"json": json, "Any": Any, "FunctionTool": function_tool.FunctionTool,
         "normalize_function_tool_return": function_tool.normalize_function_tool_return,
         "ToolResponse": schemas.ToolResponse}, cls="ToolAgentLoop")


class StockLoop:
    """The attributes of a ``ToolAgentLoop`` that ``_call_tool`` reads (its config
    defaults: ``multi_turn.max_tool_response_length`` 256, truncate side ``middle``),
    with verl's ``_call_tool`` as its method."""

    def __init__(self, tools: list[Any], max_tool_response_length: int = 256,
                 tool_response_truncate_side: str = "middle") -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.max_tool_response_length = max_tool_response_length
        self.tool_response_truncate_side = tool_response_truncate_side

    _call_tool = None  # set below, once verl is importable


def function_call(name: str, arguments: str) -> Any:
    """verl's ``FunctionCall`` (the parsed tool call ``_call_tool`` receives), from its
    tool parser module (its package ``__init__`` imports torch: skipped like verl's)."""
    load_verl_tools()
    if "verl.experimental.agent_loop.tool_parser" not in sys.modules and \
            importlib.util.find_spec("torch") is None:
        exp = sys.modules.get("verl.experimental") or _bare_package(
            "verl.experimental", sys.modules["verl"].__path__)
        if "verl.experimental.agent_loop" not in sys.modules:
            _bare_package("verl.experimental.agent_loop", exp.__path__)
    parser = importlib.import_module("verl.experimental.agent_loop.tool_parser")
    return parser.FunctionCall(name=name, arguments=arguments)


def stock_loop(tools: list[Any], **kwargs: Any) -> StockLoop:
    if StockLoop._call_tool is None:
        StockLoop._call_tool = load_call_tool()  # type: ignore[assignment]
    return StockLoop(tools, **kwargs)


class AgentData:
    """What ``_call_tool`` and the tool read of verl's ``AgentData`` (whose module
    imports torch): its ``request_id`` and the ``extra_fields`` dict verl copies
    into ``tool_extra_fields``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.extra_fields: dict[str, Any] = {}
        self.tools_kwargs: dict[str, Any] = {}


class _Row:
    """One row of a DataProto: ``batch`` (arrays) and ``non_tensor_batch`` (objects)."""

    def __init__(self, batch: dict[str, Any], non_tensor_batch: dict[str, Any]) -> None:
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch


class OneRowData:
    """What a reward manager's ``run_single`` reads of verl's ``DataProto`` (whose module
    imports torch) for one rollout: ``data[-1:]``, ``data[0]``, ``.batch`` arrays (numpy:
    slicing, ``shape``, ``sum`` as on tensors) and ``.non_tensor_batch``."""

    def __init__(self, batch: dict[str, Any], non_tensor_batch: dict[str, Any]) -> None:
        self.row = _Row(batch, non_tensor_batch)

    def __getitem__(self, index: Any) -> Any:
        return self if isinstance(index, slice) else self.row


def naive_reward_manager(compute_score: Any, tokenizer: Any) -> Any:
    """verl's ``NaiveRewardManager`` with its ``run_single`` compiled from its source; the
    attributes its ``__init__`` sets (the base class imports torch)."""
    import asyncio
    import inspect

    run_single = compile_function("experimental/reward_loop/reward_manager/naive.py",
                                  "run_single", {}, cls="NaiveRewardManager")
    manager = types.SimpleNamespace(
        tokenizer=tokenizer, loop=asyncio.get_running_loop(), compute_score=compute_score,
        is_async_reward_score=inspect.iscoroutinefunction(compute_score),
        reward_router_address=None, reward_model_tokenizer=None)
    return types.MethodType(run_single, manager)


def custom_reward_fn(path: str, name: str, reward_kwargs: dict[str, Any] | None = None) -> Any:
    """verl's ``get_custom_reward_fn`` (trainer/ppo/reward.py, compiled from its source:
    its module imports torch) on a ``reward.custom_reward_function`` config."""
    import functools
    import inspect

    from omegaconf import OmegaConf

    rel = "trainer/ppo/reward.py"
    helpers = {name: compile_function(rel, name, {})
               for name in ("_call_with_kwargs", "_call_with_kwargs_async")}
    loader = compile_function(rel, "get_custom_reward_fn",
                              {"inspect": inspect, "partial": functools.partial, **helpers})
    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": path, "name": name, "reward_kwargs": reward_kwargs or {}}}})
    return loader(config)
