"""What makes a checkpoint trustworthy: a 64-bit checksum of every array computed on the
devices (:func:`state_checksums`), a SHA-256 digest of each JSON item (:func:`json_digest`),
the step a checkpoint knows it was saved at, and a step directory found sound without
opening any of its files (:func:`damage`). :class:`jaxmp.train.checkpoint.Checkpointer`
writes and checks them; a checkpoint that fails any check is :class:`Corrupt`.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import stat
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.precision._paths import leaf_names

__all__ = ["CheckpointError", "Corrupt", "FORMAT", "state_checksums", "json_digest", "damage",
           "step_counter", "not_its_step", "check_digests"]

# 1: array checksums only; 2: also the digests of the JSON items and the health flag (and,
# in newer ones, the step the checkpoint was saved at: a format-2 checkpoint without it is
# an older one, checked by its state's step counter where it has one).
FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or incompatible with the current run."""


_ODD1, _ODD2 = np.uint32(2654435761), np.uint32(2246822519)  # Knuth's multiplicative constants
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_hash(x: jax.Array) -> jax.Array:
    """Two 32-bit position-weighted sums of the bits of ``x``: uint32 [2].

    Every weight is odd, so flipping any one bit (``+-2**k`` at one position) changes
    each sum modulo 2**32; integer sums wrap, so the value does not depend on how the
    array is sharded or in which order the devices add.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    bits = bits.reshape(-1)
    i = jnp.arange(bits.size, dtype=jnp.uint32)
    h1 = jnp.sum(bits * (i * _ODD1 | 1), dtype=jnp.uint32)
    h2 = jnp.sum((bits ^ (bits >> 13)) * ((i + np.uint32(0x9E3779B9)) * _ODD2 | 1),
                 dtype=jnp.uint32)
    return jnp.stack([h1, h2])


_hash_leaves = jax.jit(lambda leaves: [_leaf_hash(jnp.asarray(x)) for x in leaves])


def state_checksums(state: Any) -> dict:
    """``{"INDEX:leaf name": 16 hex digits}``: a 64-bit checksum of each array of ``state``.

    Computed on the devices in one jitted pass (no copy of the state to the host); leaf
    names as :func:`jaxmp.precision._paths.leaf_names`. Any single flipped bit changes the
    checksum of its leaf; other damage goes unseen with a probability of about 2**-64.
    """
    names = leaf_names(state)
    leaves = jax.tree.leaves(state)
    hashes = jax.device_get(_hash_leaves(leaves)) if leaves else []
    return {f"{i}:{n}": f"{int(h[0]):08x}{int(h[1]):08x}"
            for i, (n, h) in enumerate(zip(names, hashes))}


def json_digest(item: Any) -> str:
    """SHA-256 (hex) of a JSON item in canonical form (sorted keys, no spaces), as it
    reads back from disk: tuples and lists alike, so the digest at save time equals the
    one of the restored item."""
    text = json.dumps(json.loads(json.dumps(item)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Corrupt(Exception):
    """A checkpoint that cannot be read or does not verify (raised to
    :class:`~jaxmp.train.checkpoint.Checkpointer`, which reports it as
    :class:`CheckpointError` or sets it aside).

    Args:
      why: what is wrong with it, in words.
      unread: True when orbax (or listing its directory) failed to read it: it may have
        been deleted while it was read, by a trainer's rotation (:meth:`Checkpointer.restore`).
    """

    def __init__(self, why: str, unread: bool = False):
        super().__init__(why)
        self.unread = unread


def _kind(mode: int) -> str:
    """What a file that is neither a regular file nor a directory is, in words."""
    for test, name in ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISLNK, "symbolic link"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def damage(step_dir: pathlib.Path) -> Optional[str]:
    """Why a step directory cannot be read safely, found without opening any of its files;
    None when it is a real directory holding only regular files and directories.

    A step directory that is a symbolic link (to another step's files, say) is refused, as
    is one holding anything but regular files and directories: a named pipe hangs the
    reader that opens it (orbax reads ``_CHECKPOINT_METADATA`` as it lists the steps), and
    orbax writes neither links nor pipes.

    Raises:
      FileNotFoundError: the directory (or one inside it) vanished while it was looked at
        (a trainer's rotation deleting it).
      OSError: it cannot be listed.
    """
    mode = os.lstat(step_dir).st_mode
    if stat.S_ISLNK(mode):
        return (f"its directory is a symbolic link (to {os.readlink(step_dir)}), not a "
                f"directory of its own")
    if not stat.S_ISDIR(mode):
        return f"it is a {_kind(mode)}, not a directory"
    pending = [str(step_dir)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif not entry.is_file(follow_symlinks=False):
                    name = os.path.relpath(entry.path, step_dir)
                    kind = _kind(entry.stat(follow_symlinks=False).st_mode)
                    return f"its file {name} is a {kind}, not a regular file"
    return None


def step_counter(state: Any) -> Optional[int]:
    """The step counter of a restored state (``TrainState.step``), or None where it has
    no integer scalar ``step``."""
    counter = getattr(state, "step", None)
    if counter is None or np.ndim(counter) != 0 or not np.issubdtype(
            np.asarray(jax.device_get(counter)).dtype, np.integer):
        return None
    return int(jax.device_get(counter))


def not_its_step(step: int, own: int, source: str) -> str:
    """Why checkpoint ``step`` is corrupt when it is that of step ``own`` (``source``
    says who says so)."""
    return (f"it is the checkpoint of step {own} ({source}), not of step {step}: a copy, a "
            f"link or a renamed directory of another step")


def check_digests(meta: dict) -> Optional[dict]:
    """The JSON items' digests of a format-2 ``verify`` item after checking ``verify``
    itself against its own digest; None for a format-1 checkpoint (arrays only).

    Raises:
      Corrupt: the digests are missing or ``verify`` was altered.
    """
    if meta.get("format") == 1 and "digest" not in meta:
        return None
    rest = {k: v for k, v in meta.items() if k != "digest"}
    items = meta.get("items")
    if (meta.get("format") != FORMAT or not isinstance(meta.get("digest"), str)
            or json_digest(rest) != meta["digest"] or not isinstance(items, dict)
            or not {"data", "config"} <= set(items)):
        raise Corrupt("its checksums item (verify) was altered or is incomplete")
    return items
