"""A block on its way into a tier (a local one on demotion, the shared one when shared)."""

from __future__ import annotations

from cachesvc.kv.codec import Codec, KVBlock, is_lossy
from cachesvc.kv.retention import Retention
from cachesvc.kv.tiers.base import TierItem
from cachesvc.kv.types import BlockHash


class Payload:
    """A block to store: its KV, or a blob with the codec of the tier it comes from (which
    verifies it), encoded lazily per codec; with its retention and owner, which it keeps from
    tier to tier."""

    def __init__(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        *,
        block: KVBlock | None = None,
        blob: bytes | None = None,
        source: Codec | None = None,
        retention: Retention | None = None,
        tenant: str | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self._block = block
        self._blob = blob
        self._source = source
        self.retention = retention
        self.tenant = tenant

    @property
    def lossy(self) -> bool:
        """Whether the KV is lossy (dequantized, or computed over such KV): only a quantized
        codec may store it."""
        if self._block is not None:
            return self._block.lossy
        assert self._blob is not None
        return is_lossy(self._blob)

    def encoded(self, codec: Codec) -> bytes | None:
        """The block in `codec`'s encoding; None when the blob fails verification. Raises
        LossyKVError for lossy KV and a lossless codec (check `lossy` first)."""
        if self._block is not None:
            b = self._block
            return codec.encode(b.block_hash, b.parent, b.dtype, b.array, lossy=b.lossy)
        assert self._blob is not None
        return codec.transcode(self._blob, self.block_hash, self._source)

    def item(self, data: bytes) -> TierItem:
        """The tier item of the block encoded as `data`."""
        return TierItem(self.block_hash, self.parent, data, self.retention, self.tenant)
