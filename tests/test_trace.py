"""Per-request marks (hcfjax.trace): off until an entry point enables a directory, one file per process there, and
the CLI enables the directory its environment names."""

from __future__ import annotations

import os

import pytest

from hcfjax import trace
from hcfjax.cli import main as cli_main


@pytest.fixture
def tracing_off():
    trace.enable(None)
    yield
    trace.enable(None)


@pytest.mark.usefixtures("tracing_off")
def test_marks_go_where_enabled(tmp_path):
    trace.mark("dropped", "r0")
    assert not trace.enabled() and trace.directory() is None
    first, second = tmp_path / "a", tmp_path / "b"
    trace.enable(first)
    trace.mark("arrive", "r1", n=3)
    trace.mark("first", "r1")
    trace.enable(second)  # the next marks go to the new directory
    trace.mark("arrive", "r2")
    trace.enable(None)
    trace.mark("dropped", "r3")
    assert [p.name for p in first.iterdir()] == [f"trace-{os.getpid()}.jsonl"]
    events = trace.read(first)
    assert [(e["ev"], e["key"]) for e in events] == [("arrive", "r1"), ("first", "r1")] and events[0]["n"] == 3
    assert set(trace.by_key(events)["r1"]) == {"arrive", "first"}
    assert [(e["ev"], e["key"]) for e in trace.read(second)] == [("arrive", "r2")]


@pytest.mark.usefixtures("tracing_off")
def test_cli_enables_the_directory_its_environment_names(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.DIR_VARIABLE, str(tmp_path))
    assert cli_main(["generate", "--prompt", "x", "--model", str(tmp_path / "none")]) == 2  # no model: no work
    assert trace.directory() == tmp_path
