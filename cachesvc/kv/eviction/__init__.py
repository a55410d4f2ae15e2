"""Eviction policies: which evictable block goes first, for the device pool and the local tiers."""
