"""Stream event ids: the SSE ``id:`` of each chunk, and what resuming after one skips.

Every chunk of a streaming response gets a unique, increasing id, derived from
the captured frames alone (token and final sequence numbers), so any replica
numbers a stream the same way:

- ``1``: the chat role chunk, sent before the first token;
- ``s + 1``: the content chunk whose last token has sequence ``s`` (tokens start
  at 1, so the first content chunk is 2);
- ``f + 1``: the closing chunk, sent when no token carried the finish reason
  (``f``, the final frame's sequence, is the last token's plus one);
- ``f + 2``: the usage chunk (``stream_options.include_usage``).

``data: [DONE]`` and error events end a response and carry no id. Resuming after
id ``n`` replays exactly the chunks whose id is greater than ``n``; a resume past
every chunk gets ``[DONE]`` alone.
"""

from __future__ import annotations

ROLE_ID = 1


def content_id(token_seq: int) -> int:
    """The id of a content chunk whose last token has sequence ``token_seq``."""
    return token_seq + 1


def finish_id(final_seq: int) -> int:
    """The id of the closing chunk, from the final frame's sequence."""
    return final_seq + 1


def usage_id(final_seq: int) -> int:
    """The id of the usage chunk, from the final frame's sequence."""
    return final_seq + 2


def tokens_through(last_event_id: int) -> int:
    """The last token sequence a client that got ``last_event_id`` already has."""
    return max(last_event_id - 1, 0)
