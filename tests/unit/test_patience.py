"""streams.patience: a start-up lookup that times out is asked again; any other
error is final."""

from __future__ import annotations

import nats.errors
import pytest

from streams.patience import patiently
from tools.errors import EffectLedgerError


async def test_a_timeout_is_asked_again_until_it_answers() -> None:
    calls = 0

    async def lookup() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            # As tools/effects.py raises it: the timeout is the cause.
            raise EffectLedgerError("cannot open bucket") from nats.errors.TimeoutError()
        return "bound"

    assert await patiently(lookup, within_s=10) == "bound"
    assert calls == 3


async def test_another_error_is_final_and_a_late_timeout_gives_up() -> None:
    calls = 0

    async def denied() -> str:
        nonlocal calls
        calls += 1
        raise nats.errors.NoRespondersError()

    with pytest.raises(nats.errors.NoRespondersError):
        await patiently(denied, within_s=10)
    assert calls == 1

    async def never() -> str:
        raise TimeoutError

    with pytest.raises(TimeoutError):
        await patiently(never, within_s=0)
