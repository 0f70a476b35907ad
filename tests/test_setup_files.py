"""The set-up files agree with each other: pyproject.toml's ranges, the lock the suite passes
with (requirements/lock.txt, requirements/embedded.txt), scripts/setup.sh and conda.yaml."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = "requirements/lock.txt"
EMBEDDED = "requirements/embedded.txt"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _pins(rel: str) -> dict[str, Version]:
    """``{canonical name: version}`` of a lock file; every non-comment line must be ``name==X``."""
    pins: dict[str, Version] = {}
    for n, line in enumerate((REPO / rel).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)", line)
        assert m, f"{rel}:{n}: not an exact pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{rel}:{n}: {name} pinned twice"
        pins[name] = Version(m.group(2))
    return pins


def _lock_python() -> str:
    """The ``major.minor`` Python version the lock's header says it was made with."""
    m = re.search(r"Python (\d+\.\d+)", (REPO / LOCK).read_text(encoding="utf-8"))
    assert m, f"{LOCK}'s header names no Python version"
    return m.group(1)


def _requirements(group: str | None) -> list[Requirement]:
    project = _pyproject()["project"]
    lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return [Requirement(s) for s in lines]


def _conda() -> dict:
    return yaml.safe_load((REPO / "conda.yaml").read_text(encoding="utf-8"))


def _conda_pip(env: dict) -> list[str]:
    for dep in env["dependencies"]:
        if isinstance(dep, dict) and "pip" in dep:
            return [str(x) for x in dep["pip"]]
    raise AssertionError("conda.yaml has no pip section")


@pytest.mark.parametrize(("group", "lock"), [(None, LOCK), ("test", LOCK), ("embedded", EMBEDDED)])
def test_lock_pins_every_dependency_within_its_range(group: str | None, lock: str) -> None:
    pins = _pins(lock)
    reqs = _requirements(group)
    assert reqs, f"no requirements in group {group!r}"
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{lock} does not pin {req.name} (pyproject.toml)"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"pyproject.toml's {req} does not admit the locked {req.name}=={pins[name]}"


def test_major_dependencies_have_upper_bounds() -> None:
    """A new major version is untested: every runtime range names its bound."""
    for req in _requirements(None):
        assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), \
            f"{req} has no upper bound"


def test_lock_is_portable() -> None:
    """No editable or local installs, no local build labels (torch's ``+cpu`` is chosen by
    scripts/setup.sh per machine), and mistill and the embedded wheels stay out of the main lock
    (those are installed with --no-deps)."""
    pins = _pins(LOCK)
    assert all(v.local is None for v in pins.values()), "a local version label in the lock"
    for name in ("mistill", *map(canonicalize_name, _pins(EMBEDDED))):
        assert name not in pins, f"{name} must not be in {LOCK}"
    assert "torch" in pins and "pip" in pins


def test_setup_script_installs_the_lock() -> None:
    text = (REPO / "scripts/setup.sh").read_text(encoding="utf-8")
    assert f"LOCK={LOCK}" in text and f"EMBEDDED={EMBEDDED}" in text
    assert re.search(r'pip install -q -r "\$LOCK"', text)
    assert re.search(r"pip install -q --no-deps -e \.", text)
    assert re.search(r'pip install -q --no-deps -r "\$EMBEDDED"', text)
    stamp = re.search(r"^want=\$\(cat ([^|]*)\|", text, re.M)
    assert stamp, "setup.sh's idempotence stamp is gone"
    for item in ("pyproject.toml", '"$LOCK"', '"$EMBEDDED"', "scripts/setup.sh"):
        assert item in stamp.group(1).split(), f"the stamp does not cover {item}"


def test_conda_env_reproduces_the_lock() -> None:
    env = _conda()
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and re.match(r"python\b", d)]
    assert pythons == [f"python={_lock_python()}"], pythons
    assert "pip" in env["dependencies"]
    pip = _conda_pip(env)
    assert f"-r {LOCK}" in pip and f"-r {EMBEDDED}" in pip and "-e ." in pip
    # Nothing else is installed by a loose range next to the lock.
    loose = [x for x in pip if not x.startswith(("-r ", "-e ", "--extra-index-url "))]
    assert not loose, loose


def test_python_versions_agree() -> None:
    lock = Version(_lock_python())
    assert _pyproject()["project"]["requires-python"] == f">={lock}"
    assert f"sys.version_info < ({lock.major}, {lock.minor})" in \
        (REPO / "scripts/setup.sh").read_text(encoding="utf-8")


def test_console_script_entry() -> None:
    scripts = _pyproject()["project"]["scripts"]
    assert scripts["mistill"] == "mistill.stages.cli:console"
    module, _ = scripts["mistill"].split(":")
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()
