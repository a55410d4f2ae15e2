"""The NVMe tier's retentions on disk (`RetentionJournal`), so they survive a restart with the
blocks.

One JSON line per change, appended: `[hash, cls, expires_at, tenant, session]` retains a block,
`[hash]` ends its retention. On start the lines are replayed (the last word on a hash wins) and
the file is rewritten with what is still retained; it is rewritten too once it holds many more
lines than retentions. A retention is soft: a line lost in a crash, or a torn last line, only
costs a block its retention, so lines are not fsynced and unreadable ones are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from cachesvc.kv.retention import Retention
from cachesvc.kv.types import BlockHash

NAME = "retention.jsonl"  # not a block file name: the tier's listing skips it
_MIN_COMPACT = 4096  # lines before the file is worth rewriting


def _line(block_hash: BlockHash, retention: Retention | None) -> str:
    if retention is None:
        return json.dumps([block_hash.hex()]) + "\n"
    r = retention
    return json.dumps([block_hash.hex(), r.cls, r.expires_at, r.tenant, r.session]) + "\n"


def _parse(line: str) -> tuple[BlockHash, Retention | None] | None:
    try:
        fields = json.loads(line)
        h = BlockHash(bytes.fromhex(fields[0]))
        if len(fields) == 1:
            return h, None
        cls, expires_at, tenant, session = fields[1:]
        return h, Retention(int(cls), float(expires_at), str(tenant), session)
    except (ValueError, TypeError, IndexError, KeyError):
        return None  # a torn or foreign line


class RetentionJournal:
    """The journal file in `folder`. Raises OSError where the folder is unusable."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / NAME
        self._file: IO[str] | None = None
        self._num_lines = 0

    def load(self) -> dict[BlockHash, Retention]:
        """The retentions the file records, the least recently retained first (expired ones
        included: the caller drops them)."""
        out: dict[BlockHash, Retention] = {}
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    parsed = _parse(line)
                    if parsed is None:
                        continue
                    h, retention = parsed
                    out.pop(h, None)  # the last line on a hash places it in the order
                    if retention is not None:
                        out[h] = retention
        except FileNotFoundError:
            pass
        return out

    def record(self, block_hash: BlockHash, retention: Retention | None) -> None:
        """Append one change (None: the retention ended)."""
        if self._file is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._file.write(_line(block_hash, retention))
        self._file.flush()
        self._num_lines += 1

    def worth_compacting(self, num_live: int) -> bool:
        return self._num_lines > max(_MIN_COMPACT, 4 * num_live)

    def rewrite(self, live: Mapping[BlockHash, Retention]) -> None:
        """Replace the file with one line per live retention (temp file + rename); with none,
        there is no file."""
        self.close()
        self._num_lines = len(live)
        if not live:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        tmp = self.path.with_name(f".{NAME}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(_line(h, r) for h, r in live.items())
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
