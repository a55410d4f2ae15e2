"""The engine's lower cache tiers: start-up, matching, planned loads, landing, writes
(demotion, sharing), calibration and metrics. `kv_tiering.KVTiering` is the entry point."""
