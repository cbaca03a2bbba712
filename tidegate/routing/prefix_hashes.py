"""The prefix cache's block hashes, computed the same way by the worker's block manager and
by the API routing a job to the worker that holds its prompt's longest cached prefix.

A full block of ``block_size`` prompt tokens is named by a hash of (the previous block's hash,
its token ids); a chain of these names a prefix. Keys and values computed with a LoRA adapter
start the chain from a salt naming it, so they never match the base model's. Announcements
carry each hash's first 8 bytes (``short``): a collision only costs a routing choice.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

if array("i").itemsize != 4:  # pragma: no cover - every platform tidegate runs on
    raise ImportError("tidegate needs 4-byte C ints (array 'i')")


def _int32_le(token_ids: Sequence[int]) -> bytes:
    """The token ids as little-endian int32s (one C-level conversion, not one call per id)."""
    packed = array("i", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A collision-resistant id for a full block given everything before it."""
    return _chained(parent, _int32_le(token_ids))


def _chained(parent: bytes | None, block: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    h.update(block)
    return h.digest()


def adapter_salt(adapter: str | None) -> bytes | None:
    """What a request's first block hash starts from: keys and values computed with an
    adapter are that adapter's (every projection's output differs), never the base model's."""
    return None if adapter is None else b"lora\0" + adapter.encode()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: bytes | None = None, *, whole: bool = False) -> list[bytes]:
    """The hashes of the prompt's full blocks that a prefix cache can serve: those lying wholly
    before the last token (that token is always computed: its logits pick the next one);
    ``whole``: every full block. ``salt``: what the first block's hash starts from (an
    adapter's salt, or the hash of the block before ``token_ids``)."""
    hashes: list[bytes] = []
    parent = salt
    step = 4 * block_size
    data = _int32_le(token_ids)
    for i in range((len(token_ids) - (0 if whole else 1)) // block_size):
        parent = _chained(parent, data[i * step:(i + 1) * step])
        hashes.append(parent)
    return hashes


def short(h: bytes) -> int:
    """The 8-byte name of a block hash that announcements carry."""
    return int.from_bytes(h[:8], "little")
