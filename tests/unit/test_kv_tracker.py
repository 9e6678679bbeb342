"""The worker's half of the KV index: vLLM's KV events (both wire shapes) turned
into prefix keys held and withdrawn."""

from __future__ import annotations

import msgspec
import pytest

from sim.kv import BlockManager
from sim.kv_events import KvEventSink
from streams.kv_index import KvIndexDelta, PrefixKey, encode_delta, prefix_keys
from workers.inference import kv_tracker
from workers.inference.kv_events import Removed, Stored, decode_batch
from workers.inference.kv_tracker import LEARN_WAIT_S, MAX_HELD_KEYS, KvTracker


def _events_of(sink: KvEventSink) -> list[Stored | Removed]:
    batch = sink.take()
    assert batch is not None
    events = decode_batch(msgspec.msgpack.encode(batch))
    return [e for e in events if isinstance(e, Stored | Removed)]


def test_decodes_the_map_shape_of_later_vllm_versions() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 1.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [b"\x02" * 32], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            "data_parallel_rank": 0,
        }
    )
    stored, removed, cleared = decode_batch(payload)
    assert stored == Stored([b"\x01" * 32], None, 2)
    assert removed == Removed([b"\x01" * 32])
    assert type(cleared).__name__ == "Cleared"


def test_keys_are_tied_to_the_requests_chain_and_withdrawn_on_eviction() -> None:
    sink = KvEventSink()
    kv = BlockManager(num_blocks=8, block_size=2, events=sink)
    tracker = KvTracker()
    keys = [PrefixKey(101, 0.5), PrefixKey(102, 1.0)]
    # A prompt of 8 tokens: 4 full blocks; key 101 needs the first 2, key 102 all 4.
    since = tracker.mark()
    blocks = kv.allocate([1, 2, 3, 4], 4, 0, list(range(8)))
    assert blocks is not None
    tracker.apply(_events_of(sink))
    tracker.learn(keys, since, prompt_tokens=8)
    assert set(tracker.held()) == {101, 102}
    assert tracker.take() == ((101, 102), ())
    kv.free(blocks[0])
    # Another sequence takes 6 blocks: 4 free ones, then the two least recent (the
    # first one's tail: blocks 4 and 3), which key 102 needed and 101 did not.
    other = kv.allocate([11, 12, 13, 14, 15, 16], 6, 0, list(range(100, 112)))
    assert other is not None
    tracker.apply(_events_of(sink))
    assert set(tracker.held()) == {101}
    assert tracker.take() == ((), (102,))


def test_an_ambiguous_or_unknown_chain_is_never_claimed() -> None:
    now = [0.0]
    outcomes: list[str] = []
    tracker = KvTracker(outcomes.append, clock=lambda: now[0])
    since = tracker.mark()
    tracker.apply([Stored([1, 2], None, 2), Stored([11, 12], None, 2)])
    tracker.learn([PrefixKey(7, 1.0)], since, prompt_tokens=4)  # two chains of 2 blocks
    assert tracker.held() == ()
    tracker.apply([Stored([21, 22], 999, 2)])  # a parent it never heard of
    tracker.learn([PrefixKey(8, 1.0)], tracker.mark() - 1, prompt_tokens=4)
    assert tracker.held() == ()
    now[0] = LEARN_WAIT_S
    tracker.expire()
    assert outcomes == ["unattributed", "unattributed"]


def test_a_request_waits_for_the_events_of_its_prefill() -> None:
    outcomes: list[str] = []
    tracker = KvTracker(outcomes.append)
    tracker.apply([Stored([1], None, 2)])  # block_size known
    since = tracker.mark()
    # The answer came first (HTTP), the events after (ZMQ).
    tracker.learn([PrefixKey(7, 1.0)], since, prompt_tokens=4)
    assert outcomes == []
    tracker.apply([Stored([31, 32], None, 2)])
    assert outcomes == ["learnt"]
    assert tracker.held() == (7,)


def test_lost_events_withdraw_everything() -> None:
    tracker = KvTracker()
    since = tracker.mark()
    tracker.apply([Stored([1, 2], None, 2)])
    tracker.learn([PrefixKey(7, 1.0)], since, prompt_tokens=4)
    tracker.take()
    tracker.reset()  # the feed saw a gap in the engine's sequence numbers
    assert tracker.held() == ()
    assert tracker.take() == ((), (7,))


def test_prefix_keys_chain_over_chunks_and_scope() -> None:
    text = "x" * 600
    keys = prefix_keys("acme", text, 1200)
    assert len(keys) == 3  # 256, 512, 600
    assert [round(k.share, 3) for k in keys] == [0.213, 0.427, 0.5]
    longer = prefix_keys("acme", text + "y" * 100, 1200)
    assert [k.key for k in longer[:2]] == [k.key for k in keys[:2]]
    assert longer[2].key != keys[2].key  # the last chunk differs
    assert prefix_keys("beta", text, 1200)[0].key != keys[0].key


def test_a_known_prefix_or_its_cache_hits_tell_concurrent_look_alikes_apart() -> None:
    tracker = KvTracker()
    since = tracker.mark()
    tracker.apply([Stored([1, 2], None, 2)])
    tracker.learn([PrefixKey(10, 0.5)], since, prompt_tokens=4)
    assert tracker.held() == (10,)  # key 10: block 1
    # Two requests of one length at once: B shares key 10's text (and hit block 1),
    # C has a text of its own (nothing cached).
    since = tracker.mark()
    tracker.apply([Stored([3], 1, 2), Stored([21, 22], None, 2)])
    tracker.learn([PrefixKey(10, 0.5), PrefixKey(11, 1.0)], since, 4, cached_tokens=2)
    assert set(tracker.held()) == {10, 11}  # B: the chain through block 1
    tracker.learn([PrefixKey(20, 1.0)], since, 4, cached_tokens=0)
    assert 20 not in tracker.held()  # C: either chain could be its own


def test_a_key_dropped_learnt_and_dropped_again_before_a_flush_is_withdrawn() -> None:
    """Dropped (queued for removal), learnt again (the removal undone and queued as
    an add), dropped again (the add discarded, never said): the gateways kept the
    first claim for ever."""
    tracker = KvTracker()
    tracker._hold(42, (b"a",))
    assert tracker.take() == ((42,), ())  # the gateways know it
    tracker._drop(42)
    tracker._hold(42, (b"b",))
    tracker._drop(42)
    assert tracker.take() == ((), (42,))
    tracker._hold(7, (b"c",))
    tracker._drop(7)
    assert tracker.take() == ((), ())  # never said: nothing to take back


def test_held_keys_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts with a common head and a varied tail each left a key on the same hot
    blocks: 60,000 keys on 20 blocks, and a refresh over the bus's 1 MB never went
    out again. Past the bound the oldest is let go (and withdrawn)."""
    monkeypatch.setattr(kv_tracker, "MAX_HELD_KEYS", 3)
    tracker = KvTracker()
    for key in range(1, 6):
        tracker._hold(key, (b"hot",))
    assert set(tracker.held()) == {3, 4, 5}
    added, removed = tracker.take()
    assert set(added) == {3, 4, 5}  # 1 and 2 were never said: nothing to withdraw
    assert removed == ()


def test_a_refresh_of_every_held_key_fits_the_bus() -> None:
    refresh = KvIndexDelta("worker-with-a-long-id-0", tuple(range(2**63 - MAX_HELD_KEYS, 2**63)))
    assert len(encode_delta(refresh)) < 1 << 20  # nats-server's default max_payload
