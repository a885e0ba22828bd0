"""The SDK is a distribution of its own, `tangram-sdk` (tangram_sdk/pyproject.toml): a
training job that only talks to a server installs it without the core. Here it is built
from a copy of tangram_sdk/ (so the checkout gets no build files) and installed into a
fresh venv that holds nothing but httpx and the packages httpx needs, taken from this
environment, with ``--no-index``: the install fails if the distribution asks for anything
else. In that venv the SDK imports and ``import tangram`` fails. The main distribution,
tangram-rl, still ships tangram_sdk (tests/test_sdk.py, tests/test_layering.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent
SDK = ROOT / "tangram_sdk"
SDK_PROJECT = tomllib.loads((SDK / "pyproject.toml").read_text())["project"]
MAIN_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: each extra of tangram-sdk: the framework its adapter imports (and the adapter's module)
EXTRAS = {"gym": "gymnasium", "skyrl": "skyrl-gym"}


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _sources() -> set[str]:
    """The SDK's modules as paths inside the wheel (tangram_sdk/...), build files aside."""
    return {"tangram_sdk/" + p.relative_to(SDK).as_posix() for p in SDK.rglob("*.py")
            if not {"build", "dist"} & set(p.relative_to(SDK).parts)}


# -- the distribution's declarations --------------------------------------------------------
def test_the_sdk_distribution_depends_on_httpx_only_and_matches_the_main_one():
    assert SDK_PROJECT["name"] == "tangram-sdk"
    assert SDK_PROJECT["version"] == MAIN_PROJECT["version"]
    assert SDK_PROJECT["requires-python"] == MAIN_PROJECT["requires-python"]
    # the SDK imports nothing but the standard library and httpx (tests/test_sdk.py), and
    # asks for the same httpx as tangram-rl, which ships the same modules
    httpx = [d for d in MAIN_PROJECT["dependencies"] if _name(d) == "httpx"]
    assert SDK_PROJECT["dependencies"] == httpx, SDK_PROJECT["dependencies"]
    # an extra per framework whose adapter needs more than httpx, tested with the versions of
    # tangram-rl's `integrations` extra
    tested = {_name(r): Requirement(r) for r in MAIN_PROJECT["optional-dependencies"]["integrations"]}
    extras = SDK_PROJECT["optional-dependencies"]
    assert {k: [_name(r) for r in v] for k, v in extras.items()} == \
        {k: [v] for k, v in EXTRAS.items()}
    for extra, framework in EXTRAS.items():
        (wanted,) = extras[extra]
        for version in (s.version for s in tested[framework].specifier if s.operator == "=="):
            assert Requirement(wanted).specifier.contains(version), (extra, wanted, version)


# -- built and installed alone --------------------------------------------------------------
def _closure(name: str, seen: set[str]) -> None:
    """``name`` and the distributions it needs here (markers evaluated, no extras)."""
    if _name(name) in seen:
        return
    seen.add(_name(name))
    for text in importlib.metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            _closure(req.name, seen)


def _link_dists(names: set[str], into: Path) -> None:
    """Symbolic links in ``into`` to the installed files of ``names`` (their top-level
    packages and modules and their .dist-info), so that pip in another venv sees them
    installed."""
    into.mkdir()
    for name in names:
        dist = importlib.metadata.distribution(name)
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)


def _build_wheel(tmp: Path) -> Path:
    """tangram_sdk/ copied and built with pip: with this environment's setuptools when it
    builds wheels itself (setuptools >= 70.1, or the `wheel` package), else in pip's isolated
    build environment (setuptools from the index or pip's cache, as `pip install -e .` of
    the main project does)."""
    src = tmp / "src" / "tangram_sdk"
    shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("__pycache__", "build", "dist",
                                                            "*.egg-info"))
    setuptools = importlib.metadata.version("setuptools").split(".")
    local = (int(setuptools[0]), int(setuptools[1])) >= (70, 1) \
        or importlib.util.find_spec("wheel") is not None
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
           "-q", "-w", str(tmp / "dist"), str(src)]
    if local:
        cmd[4:4] = ["--no-build-isolation", "--no-index"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"building tangram-sdk failed:\n{done.stdout}{done.stderr}"
    (wheel,) = (tmp / "dist").glob("tangram_sdk-*.whl")
    return wheel


def test_the_sdk_installs_alone_into_a_fresh_venv_without_the_core(tmp_path):
    wheel = _build_wheel(tmp_path)
    # the wheel holds every module of tangram_sdk/ and nothing of the core
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert {n for n in names if n.endswith(".py")} == _sources(), names
    assert {n.split("/")[0] for n in names} == \
        {"tangram_sdk", f"tangram_sdk-{SDK_PROJECT['version']}.dist-info"}, names

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    # httpx and what it needs, and nothing else, from this environment (no index needed)
    deps: set[str] = set()
    _closure("httpx", deps)
    _link_dists(deps, tmp_path / "deps")
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    (site / "deps.pth").write_text(str(tmp_path / "deps") + "\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}

    def pip(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python),
                               "--disable-pip-version-check", *args], capture_output=True,
                              text=True, timeout=120, env=env, cwd=tmp_path)
        assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    # --no-index: tangram-sdk's dependencies must be met by httpx's closure alone
    pip("install", "--no-index", "--no-compile", str(wheel))
    pip("check")
    installed = {_name(d["name"]) for d in json.loads(pip("list", "--format=json"))}
    assert installed == deps | {"tangram-sdk"}, installed

    done = subprocess.run([str(python), "-c", """
import importlib.metadata, importlib.util, pathlib, sys
import tangram_sdk, tangram_sdk.client, tangram_sdk.units
import tangram_sdk.integrations.common, tangram_sdk.integrations.groups
import tangram_sdk.integrations.teacher, tangram_sdk.integrations.verl
from tangram_sdk.client import TangramClient, TangramSyncClient
from tangram_sdk.integrations.verl import HAVE_VERL, TangramTool
assert not HAVE_VERL
TangramSyncClient('http://127.0.0.1:1', 't').close()
print(pathlib.Path(tangram_sdk.__file__).parent)
for gone in ('tangram', 'numpy', 'simpy', 'tangram_cli', 'executor', 'sim'):
    assert importlib.util.find_spec(gone) is None, gone
try:
    import tangram
except ModuleNotFoundError:
    print('no core')
try:
    import tangram_sdk.integrations.gym
except ImportError as e:
    print(e)
print(sorted(importlib.metadata.requires('tangram-sdk')))
"""], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    where, core, gym, requires = done.stdout.splitlines()
    assert Path(where) == site / "tangram_sdk", where
    assert core == "no core"
    assert "pip install" in gym, gym
    assert "httpx>=0.27" in requires, requires


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_is_named_where_its_adapter_fails_without_its_framework(extra):
    """The adapter's ImportError names what to install."""
    text = (SDK / "integrations" / f"{extra}.py").read_text()
    assert f"tangram-sdk[{extra}]" in text, f"tangram_sdk/integrations/{extra}.py"
