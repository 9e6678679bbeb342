"""Embedding vectors on the bus: float32, packed.

An engine computes embeddings in float32 (or narrower) and can send them as
OpenAI's ``base64`` format: little-endian float32 bytes. Carried that way from
engine to gateway, a vector of 384 dimensions is 1.5 KB of bytes (2 KB once the
frame's JSON base64-encodes them) where JSON floats are ~7.5 KB, parsed and
printed twice on the way; the frames capture stores the terminal frame, so every
byte saved is saved twice more. The gateway unpacks only for a client that asked
for floats, and then to the same values the engine's own float answer holds (a
float32 widened to a Python float prints the same either way).

A vector is either form: :data:`Vector`. An engine that ignores
``encoding_format`` answers floats, which are carried as they came (they may be
wider than float32, and are not narrowed).
"""

from __future__ import annotations

import sys
from array import array

Vector = list[float] | bytes  # floats as the engine gave them, or packed float32 LE


def floats(vector: Vector) -> list[float]:
    """The vector's values (a packed one widened from float32)."""
    if not isinstance(vector, bytes):
        return vector
    values = array("f")
    values.frombytes(vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def packed(vector: Vector) -> bytes:
    """The vector as little-endian float32 bytes (floats are narrowed)."""
    if isinstance(vector, bytes):
        return vector
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def check_packed(vector: bytes) -> bytes:
    """A packed vector from an engine, refused when it cannot be float32s."""
    if len(vector) % 4:
        raise ValueError(f"a float32 vector of {len(vector)} bytes")
    return vector
