"""The default sandbox image's python packages: pytest and pytest-xdist.

The docker backend's default image is an empty root filesystem run on the host's
``/usr`` (executor/backends/docker/backend.py), so its python is the host's
``/usr/bin/python3``, which need not have pytest. The reward commands Tangram ships
(``python3 -m pytest -q tests``, elastic: ``pytest -n <cores>``) need pytest and
pytest-xdist, so ``tangram image build`` adds them: pure-python wheels from PyPI
(``pip download``, on the host: the image is imported from a tar, no build step
reaches a network), unpacked into ``SITE`` inside the image, which ``PYTHONPATH``
names. On a machine without PyPI, download the wheels elsewhere
(``pip download --only-binary=:all: --python-version 3.11 pytest pytest-xdist -d
DIR``) and pass ``--wheels DIR``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

#: what the shipped reward commands need in the sandbox
PACKAGES = ("pytest", "pytest-xdist")
#: where they live inside the image (on PYTHONPATH; the host's /usr is mounted over /usr)
SITE = "/opt/tangram/site-packages"


def host_python_version() -> str:
    """``3.11``: the version of the host's /usr/bin/python3 the sandbox runs."""
    out = subprocess.run(["/usr/bin/python3", "-c",
                          "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError("the host has no /usr/bin/python3 (the sandbox's python)")
    return out.stdout.strip()


def download(dest: Path, packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    """Pure-python wheels of ``packages`` and their dependencies, from PyPI into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
           "--python-version", host_python_version(), "--dest", str(dest), *packages]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise RuntimeError("cannot download " + " ".join(packages) + " from PyPI ("
                           + " / ".join(tail) + "); download the wheels where PyPI is "
                           "reachable and pass --wheels DIR")
    return sorted(dest.glob("*.whl"))


def wheel_files(wheels: list[Path]) -> dict[str, bytes]:
    """The image files of ``wheels`` unpacked under SITE (pure-python wheels only: a
    wheel is a zip of its site-packages tree)."""
    if not wheels:
        raise ValueError("wheels: none given")
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    missing = [p for p in PACKAGES if p not in names]
    if missing:
        raise ValueError(f"wheels: {missing} missing (need {list(PACKAGES)} and their "
                         "dependencies)")
    files: dict[str, bytes] = {}
    for wheel in wheels:
        if not wheel.name.endswith("-none-any.whl"):
            raise ValueError(f"wheels: {wheel.name} is not a pure-python wheel (*-none-any.whl)")
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if not info.is_dir():
                    files[f"{SITE}/{info.filename}"] = z.read(info)
    return files


def build(tag: str, wheels_dir: Path | None, scratch: Path) -> str:
    """Build the default sandbox image with pytest + pytest-xdist (executor.backends.docker.backend)."""
    from executor.backends.docker.backend import build_image

    wheels = (sorted(wheels_dir.glob("*.whl")) if wheels_dir is not None
              else download(scratch))
    return build_image(tag=tag, files=wheel_files(wheels), env={"PYTHONPATH": SITE})
