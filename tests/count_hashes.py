"""A plugin (``plugins=[tests.count_hashes]``) that counts checkpoint hashing: every file a process hashes
(:func:`sdp.rank.checkpoint_io.file_entry`, what verifying a checkpoint reads) appends ``<RANK> <file>`` to the file
``$SDP_TEST_HASH_LOG``, so a test counts hash calls per job across the job's processes without a hook in sdp."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdp.rank import checkpoint_io

LOG_ENV = "SDP_TEST_HASH_LOG"
_hash = checkpoint_io.file_entry


def _counted(path: Path) -> dict[str, Any]:
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(f"{os.environ.get('RANK', 'driver')} {path}\n")
    return _hash(path)


if LOG_ENV in os.environ and checkpoint_io.file_entry is _hash:
    checkpoint_io.file_entry = _counted
