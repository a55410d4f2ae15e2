"""The data plane between workers: how KV moves from one worker to another.

A transfer is planned by the puller's load planner, staged by the holder at a step boundary
(`workers.peer.export`), moved here — one buffer per chunk, out of band through Ray's
object store, never pickled, never on an engine's loop — verified by the puller against its own
hash chain (`chunk.verify_chunk`) and landed as device blocks. Nothing here imports the engine.
"""
