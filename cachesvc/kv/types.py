"""Identifiers shared by the cache, the router and the workers."""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)
RequestId = NewType("RequestId", str)
WorkerId = NewType("WorkerId", str)
