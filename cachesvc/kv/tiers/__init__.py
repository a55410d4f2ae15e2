"""Tiers below the device pool (DRAM, NVMe, Redis) and the manager that moves blocks among them.

Implementations are imported lazily through `make_tier`, so Redis is imported only when used.
"""

from cachesvc.kv.tiers.base import Tier, TierItem, TierStats, make_tier, register_tier

__all__ = ["Tier", "TierItem", "TierStats", "make_tier", "register_tier"]
