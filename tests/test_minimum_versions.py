"""The minimum versions CI installs (.ci/minimum-versions.txt) are the floors pyproject.toml
declares (and binder asks for the same), so that a floor changed in one place cannot go untested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    numbers = tuple(int(part) for part in text.split("."))
    return numbers + (0,) * (3 - len(numbers))


def _declared_floors() -> dict[str, tuple[int, ...]]:
    """name -> floor of [project].dependencies, and of pyarrow (the dev extra: recordings)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    runtime = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)
    dev = re.search(r"^dev = \[(.*?)\]", text, re.S | re.M)
    assert runtime and dev, "pyproject.toml: [project] dependencies or the dev extra not found"
    floors = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)', runtime.group(1)))
    floors["pyarrow"] = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)', dev.group(1)))["pyarrow"]
    return {name.lower(): _version(version) for name, version in floors.items()}


def _ci_minimums() -> dict[str, tuple[int, ...]]:
    """name -> the lowest version .ci/minimum-versions.txt pins (for any Python)."""
    pins: dict[str, tuple[int, ...]] = {}
    for line in (ROOT / ".ci" / "minimum-versions.txt").read_text(encoding="utf-8").splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].strip()
        if requirement:
            name, version = requirement.split("==")
            pins[name.lower()] = min(pins.get(name.lower(), _version(version)), _version(version))
    return pins


def test_ci_minimum_job_installs_exactly_the_declared_floors():
    declared, pinned = _declared_floors(), _ci_minimums()
    assert {"torch", "ipython", "ipywidgets", "matplotlib", "pandas", "numpy",
            "pyarrow"} <= set(declared)
    assert pinned == declared, (
        "pyproject.toml's floors and .ci/minimum-versions.txt differ: change both together "
        f"(declared {declared}, pinned {pinned})")


def test_binder_asks_for_the_declared_floors():
    text = (ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8")
    binder = {name.lower(): _version(version)
              for name, version in re.findall(r"^([A-Za-z0-9_.-]+)>=([0-9.]+)", text, re.M)}
    assert binder == _declared_floors(), "binder/requirements.txt's floors differ from pyproject's"


def test_setup_refuses_a_torch_older_than_the_declared_floor():
    # scripts/setup.sh stops at an older torch rather than let pip fetch a CUDA build
    text = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    floor = re.search(r"^torch_floor=([0-9.]+)$", text, re.M)
    assert floor and _version(floor.group(1)) == _declared_floors()["torch"]
