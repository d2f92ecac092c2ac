"""The Makefile's targets hand the user's text and flags on unchanged (a stand-in venv records the command)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


@pytest.fixture
def fake_venv(tmp_path):
    """A venv whose hcfjax and python print their arguments as JSON, marked installed (no pip runs)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("hcfjax", "python"):
        tool = venv / "bin" / name
        tool.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        tool.chmod(0o755)
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (2**31, 2**31))  # newer than pyproject.toml
    return venv


def make(target: str, venv: Path, *assignments: str, env: dict | None = None) -> list[str]:
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), target, f"VENV={venv}", *assignments],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("prompt", ['print("hello")', "x = $HOME", "it's $(shell echo hi) \\n"])
def test_make_run_passes_the_prompt_as_typed(fake_venv, prompt):
    args = make("run", fake_venv, env={"PROMPT": prompt})
    assert args[args.index("--prompt") + 1] == prompt
    args = make("run", fake_venv, f"PROMPT={prompt}")
    assert args[args.index("--prompt") + 1] == prompt


def test_make_run_default_prompt_and_test_shows_skip_reasons(fake_venv):
    env = {k: v for k, v in os.environ.items() if k != "PROMPT"}
    args = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "run", f"VENV={fake_venv}"], env=env, capture_output=True, text=True, check=True
    ).stdout
    argv = json.loads(args.strip().splitlines()[-1])
    assert argv[argv.index("--prompt") + 1] == "def fibonacci(n):" and "--stats" in argv
    assert "-rs" in make("test", fake_venv)
