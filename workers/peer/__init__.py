"""Pulling KV between workers: the holder's export, the puller's pull thread, the Ray link."""
