"""Deterministic unit-norm embeddings: the same tokens and seed give the same vector."""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
from array import array
from collections.abc import Sequence


def embed(token_ids: Sequence[int], dim: int, seed: int) -> list[float]:
    h = hashlib.blake2b(f"embed/{seed}".encode(), digest_size=16)
    h.update(array("q", token_ids).tobytes())
    rng = random.Random(int.from_bytes(h.digest(), "little"))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    return normalize(vec)


def normalize(vec: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(x * x for x in vec)) or 1.0
    return [x / norm for x in vec]


def as_float32(vec: Sequence[float]) -> list[float]:
    """The values a float32 engine holds (vLLM's pooler output): what its float
    answer prints and its base64 answer packs, the same numbers."""
    return array("f", vec).tolist()


def to_base64(vec: Sequence[float]) -> str:
    """OpenAI's base64 format: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
