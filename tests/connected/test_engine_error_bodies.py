"""An engine's error body, whatever its shape, reaches the client decoded and in
OpenAI's error shape (issue 17, item 7: a 404 came back as ``b'{"detail": ...}'``)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from jetserve.fleet import Fleet

pytestmark = pytest.mark.connected


def test_a_triton_error_body_comes_back_in_openai_shape(make_fleet: Callable[..., Fleet]) -> None:
    # The worker names a model the engine does not serve: Triton answers 400 with
    # its own body, {"error": "Request for unknown model: ..."}.
    fleet = make_fleet(
        workers=1, worker_args=["--engine-dialect", "triton", "--deployment-name", "not-served"]
    )
    r = httpx.post(
        f"{fleet.base_url}/v1/chat/completions",
        json={"model": "sim-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {fleet.api_key}"},
        timeout=20,
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "Request for unknown model: 'not-served' is not found"
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"
