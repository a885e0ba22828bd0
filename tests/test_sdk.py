"""The SDK (tangram_sdk/: the HTTP client, the framework adapters, the unit-set parser) is a
package of its own: it imports without the core or the core's dependencies, needs only httpx
besides the standard library, and its old names (tangram.client, tangram.integrations.*)
are the same modules, so old configs and imports run unchanged and nothing registers twice.
No server is started here."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import tangram.units
import tangram_sdk.units

ROOT = Path(__file__).parent.parent
SDK = ROOT / "tangram_sdk"
#: the SDK's modules, by the name they had in tangram/ before (tangram.<name>); the package
#: tangram.integrations itself is a package of its own (holding these old names), not an alias
MODULES = ("client", "integrations.common", "integrations.groups",
           "integrations.teacher", "integrations.verl", "integrations.gym",
           "integrations.skyrl")
#: each adapter imports its own framework (lazily, or in a try that names the pip package)
FRAMEWORKS = {"verl", "gymnasium", "skyrl_gym", "omegaconf"}


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# -- the SDK without the core --------------------------------------------------------------
#: the core and its dependencies (pyproject's base list, but httpx): none may be imported
BLOCKED = ("tangram", "numpy", "simpy", "pandas", "pyarrow", "matplotlib", "docker", "pynvml",
           "typer", "rich", "markdown_it", "yaml", "fastapi", "uvicorn", "httptools", "uvloop",
           *sorted(FRAMEWORKS), "torch")

WITHOUT_THE_CORE = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import tangram_sdk, tangram_sdk.client, tangram_sdk.units
import tangram_sdk.integrations, tangram_sdk.integrations.common
import tangram_sdk.integrations.groups, tangram_sdk.integrations.teacher
from tangram_sdk.client import TangramClient, TangramSyncClient
from tangram_sdk.integrations.common import RewardConfig, SandboxConfig
from tangram_sdk.integrations.verl import HAVE_VERL, TangramTool
assert not HAVE_VERL
TangramSyncClient('http://127.0.0.1:1', 't').close()
assert RewardConfig.from_dict({{'command': 'true', 'cpu': '1-8'}}).cpu == '1-8'
try:
    RewardConfig.from_dict({{'command': 'true', 'cpu': '1-999999999'}})
except ValueError as e:
    assert '1..4096' in str(e), e
else:
    raise SystemExit('an unbounded unit set was taken')
tool = TangramTool({{'base_url': 'http://127.0.0.1:1', 'token': 't', 'check_server': False}})
assert tool.settings.cpu
loaded = sorted(m for m in sys.modules if m.split('.')[0] in {BLOCKED!r})
assert not loaded, loaded
print('ok')
"""


def test_the_sdk_imports_and_runs_without_the_core_or_its_dependencies():
    assert _run(WITHOUT_THE_CORE).strip() == "ok"


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_sdk_needs_only_httpx_besides_the_standard_library():
    """Module-level imports: the standard library, httpx and the SDK itself; a framework is
    imported only by its adapter, lazily or in a ``try`` (which names its pip package).
    pyproject's base dependencies list httpx (a training job installs it, then the
    distribution with --no-deps)."""
    allowed = set(sys.stdlib_module_names) | {"__future__", "httpx", "tangram_sdk"}
    for path in sorted(SDK.rglob("*.py")):
        tree = ast.parse(path.read_text())
        at_top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            ok = allowed if id(node) in at_top else allowed | FRAMEWORKS
            bad = [n for n in names if _top(n) not in ok]
            assert not bad, f"{path.relative_to(ROOT)}:{node.lineno} imports {bad}"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("httpx") for d in deps), deps


# -- the unit-set parser: one, shared -------------------------------------------------------
def test_the_core_reads_unit_sets_with_the_sdks_parser():
    for name in ("MAX_UNITS", "MAX_ALTERNATIVES", "MAX_TEXT"):
        assert getattr(tangram.units, name) is getattr(tangram_sdk.units, name), name
    for text in ("4", "1-32", "1,2,4,8", " 2 - 3 ", "4,2,4", 7):
        counts = tangram_sdk.units.parse_counts(text, "cpu")
        assert tangram.units.parse_units(text, "cpu").choices == counts, text
    with pytest.raises(ValueError, match="cpu: counts must be in 1..4096"):
        tangram.units.parse_units("1-999999999", "cpu")


# -- the old names --------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODULES)
def test_the_old_names_are_the_sdks_modules(name):
    if name.endswith(("gym", "skyrl")):
        pytest.importorskip({"gym": "gymnasium", "skyrl": "skyrl_gym"}[name.rsplit(".")[-1]])
    old = importlib.import_module(f"tangram.{name}")
    assert old is importlib.import_module(f"tangram_sdk.{name}"), name


def test_old_imports_give_the_sdks_objects_and_one_registry():
    import tangram
    import tangram_sdk.client
    import tangram_sdk.integrations.common
    import tangram_sdk.integrations.groups
    import tangram_sdk.integrations.verl
    from tangram.client import TangramClient, TangramError, TangramSyncClient
    from tangram.integrations.common import CLOSE_LISTENERS
    from tangram.integrations.groups import SYNC_GROUPS
    from tangram.integrations.verl import TangramTool

    assert TangramClient is tangram_sdk.client.TangramClient is tangram.TangramClient
    assert TangramSyncClient is tangram_sdk.client.TangramSyncClient
    assert TangramError is tangram_sdk.client.TangramError
    assert TangramTool is tangram_sdk.integrations.verl.TangramTool
    assert SYNC_GROUPS is tangram_sdk.integrations.groups.SYNC_GROUPS
    assert CLOSE_LISTENERS is tangram_sdk.integrations.common.CLOSE_LISTENERS


def test_gym_and_skyrl_register_once_under_either_name():
    """``import tangram.integrations.gym`` / ``.skyrl`` (the old way) register the SDK's
    envs, once: a fresh process imports both names of each."""
    pytest.importorskip("gymnasium")
    pytest.importorskip("skyrl_gym")
    out = _run("""
import warnings
warnings.simplefilter('error')  # gymnasium warns when an id is registered again
import tangram.integrations.gym, tangram.integrations.skyrl
import tangram_sdk.integrations.gym, tangram_sdk.integrations.skyrl
import gymnasium, skyrl_gym
assert tangram.integrations.gym is tangram_sdk.integrations.gym
print(gymnasium.registry['tangram/Shell-v0'].entry_point)
print(skyrl_gym.registry['tangram-shell'].entry_point)
""")
    assert out.split() == ["tangram_sdk.integrations.gym:TangramEnv",
                           "tangram_sdk.integrations.skyrl:TangramTextEnv"], out


#: verl 0.9's loader of a tool config's ``class_name`` (verl.tools.tool_registry.
#: get_tool_class), as written there: a module not yet imported is run as a fresh module
#: object, and the class read from that object
VERL_LOADER = """
import importlib.util, sys
def get_tool_class(cls_name):
    module_name, class_name = cls_name.rsplit(".", 1)
    if module_name not in sys.modules:
        spec = importlib.util.find_spec(module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module = sys.modules[module_name]
    return getattr(module, class_name)
"""


def test_a_verl_tool_config_naming_the_old_path_loads_the_sdks_tool():
    """``class_name: tangram.integrations.verl.TangramTool`` through verl's loader (its
    code, without verl's imports), first in a fresh process and then once imported."""
    out = _run(VERL_LOADER + """
old = get_tool_class('tangram.integrations.verl.TangramTool')
import tangram_sdk.integrations.verl as sdk
assert old is sdk.TangramTool
assert sys.modules['tangram.integrations.verl'] is sdk
assert get_tool_class('tangram.integrations.verl.TangramTool') is sdk.TangramTool
assert get_tool_class('tangram_sdk.integrations.verl.TangramTool') is sdk.TangramTool
print('ok')
""")
    assert out.strip() == "ok"


def test_a_verl_reward_path_naming_the_old_module_loads_the_sdks_module():
    """``reward.custom_reward_function.path=pkg://tangram.integrations.verl``: verl's
    load_module imports the module by name; ``compute_score`` is then read from it (through
    the module's ``__getattr__``, which checks the reward workers' server: not done here)."""
    from tangram_sdk.integrations import verl as sdk

    module = importlib.import_module("tangram.integrations.verl")
    assert module is sdk
    assert module.score_rollout is sdk.score_rollout
