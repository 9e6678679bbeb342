"""The engine's API key reaches a worker from its environment, never a flag: every
user of the machine reads a process's arguments in /proc for as long as it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jetserve.commands.common import ENGINE_API_KEY_ENV, engine_api_key


def test_the_key_comes_from_the_environment_or_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)
    monkeypatch.delenv(f"{ENGINE_API_KEY_ENV}_FILE", raising=False)
    assert engine_api_key() is None
    secret = tmp_path / "engine.key"
    secret.write_text("sk-engine-from-file\n")
    monkeypatch.setenv(f"{ENGINE_API_KEY_ENV}_FILE", str(secret))
    assert engine_api_key() == "sk-engine-from-file"
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "sk-engine-from-env")
    assert engine_api_key() == "sk-engine-from-env"


@pytest.mark.parametrize("command", ["worker", "conformance"])
def test_no_command_takes_the_key_as_a_flag(command: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "jetserve", command, "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "--engine-api-key" not in shown.stdout
    assert ENGINE_API_KEY_ENV in shown.stdout  # and says where it comes from
