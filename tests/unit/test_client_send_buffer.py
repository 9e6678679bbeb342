"""``jetserve gateway --client-send-buffer``: 0 (the kernel's autotuning) or a
bounded SO_SNDBUF; anything else is refused with a clear error. (Its effect on a
client that stops reading: tests/faults/test_backpressure.py.)"""

from __future__ import annotations

import pytest

from jetserve.cli import build_parser
from jetserve.commands.gateway import config


def _cfg(*extra: str) -> int:
    args = build_parser().parse_args(["gateway", "--insecure", *extra])
    return config(args).client_send_buffer_bytes


def test_default_is_the_kernels_autotuning_and_a_value_is_taken() -> None:
    assert _cfg() == 0
    assert _cfg("--client-send-buffer", "16384") == 16384


@pytest.mark.parametrize("bad", ["-1", "12", "4095", str((64 << 20) + 1), "1e6"])
def test_out_of_range_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cfg("--client-send-buffer", bad)
    assert "--client-send-buffer: want 0 or 4096..67108864 bytes" in capsys.readouterr().err
