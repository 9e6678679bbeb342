"""The command line: a real process serving on a port, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys

import httpx
import pytest

from jetserve.services import free_port
from sim.cli import build_parser, config_from_args, main
from tests.sim.processes import healthy
from tests.waits import until


async def test_cli_serves_until_sigterm() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sim", "--port", str(port), "--profile", "fast",
        "--model", "cli-model", "--max-num-seqs", "3", "--fault-rate", "503=0.0",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await until(lambda: healthy(proc, client), "the simulator serving")
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == "cli-model"
            stats = (await client.get("/sim/stats")).json()
            assert stats["max_num_seqs"] == 3
            assert stats["profile"] == "fast"
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "cli-model", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        assert proc.stderr is not None
        await proc.stderr.read()


def test_cli_parses_and_rejects_bad_config() -> None:
    ns = build_parser().parse_args(
        ["--profile", "cpu-tiny", "--fault-rate", "429=0.1", "--fault-rate", "drop:3=0.05"]
    )
    cfg = config_from_args(ns)
    assert cfg.fault_rates == {"429": 0.1, "drop:3": 0.05}
    assert cfg.eff_max_model_len == 1024
    assert cfg.eff_max_num_batched_tokens == 2048  # vLLM's CPU default
    ns = build_parser().parse_args(["--max-num-batched-tokens", "512"])
    assert config_from_args(ns).eff_max_num_batched_tokens == 512
    assert main(["--max-num-batched-tokens", "0"]) == 2
    assert main(["--fault-rate", "meteor=0.5"]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--fault-rate", "nonsense"])
