"""LiteLLM's proxy as a comparison target, pointed at the same engine.

It lives in a venv of its own, installed on demand by `bench/peers/litellm.sh`
(never a jetserve dependency): $JETSERVE_PEERS/litellm, default
~/.cache/jetserve-peers/litellm. Recipe: shared/peers/RECIPES.md.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

import httpx

from jetserve.bench.targets import Target
from jetserve.services import ServiceError, free_port

# The script sits in the source tree next to the package (editable installs, checkouts).
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "litellm.sh"


def peers_dir() -> Path:
    return Path(os.environ.get("JETSERVE_PEERS") or Path.home() / ".cache" / "jetserve-peers")


def find_litellm() -> Path | None:
    exe = peers_dir() / "litellm" / "bin" / "litellm"
    return exe if exe.exists() else None


def install_litellm() -> Path:
    """Run the install script; raise with its output when it fails."""
    if not SCRIPT.exists():
        raise ServiceError(f"{SCRIPT} not found: install by hand (docs/bench.md)")
    done = subprocess.run(
        ["bash", str(SCRIPT), "install"], capture_output=True, text=True, check=False
    )
    exe = find_litellm()
    if done.returncode != 0 or exe is None:
        tail = (done.stdout + done.stderr)[-3000:]
        raise ServiceError(f"installing LiteLLM failed (exit {done.returncode}):\n{tail}")
    return exe


def config_yaml(model: str, api_base: str, master_key: str) -> str:
    """The recipe's config, one model routed to the engine under test. `hosted_vllm/`
    is LiteLLM's provider for vLLM's OpenAI server (which the simulator mimics)."""
    return (
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: hosted_vllm/{model}\n"
        f"      api_base: {api_base}\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "general_settings:\n"
        f"  master_key: {master_key}\n"
    )


class LiteLLMPeer:
    def __init__(self, exe: Path, workdir: Path, *, model: str, api_base: str) -> None:
        self.exe = exe
        self.workdir = workdir
        self.model = model
        self.api_base = api_base
        self.master_key = "sk-bench-" + secrets.token_hex(8)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def config_path(self) -> Path:
        return self.workdir / "litellm.yaml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "litellm.log"

    def command(self) -> list[str]:
        return [
            str(self.exe),
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--num_workers",
            "1",
        ]

    def start(self, timeout: float = 90.0) -> Target:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(config_yaml(self.model, self.api_base, self.master_key))
        self.port = free_port()
        # The local cost map: no fetch of model prices from the internet at start-up.
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
            )
        self._wait_ready(timeout)
        return Target(name="litellm", url=f"http://127.0.0.1:{self.port}/v1", key=self.master_key)

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.port}/health/liveliness"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ServiceError(f"litellm exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServiceError(f"litellm not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def litellm_version(exe: Path) -> str:
    done = subprocess.run(
        [
            str(exe.parent / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"
