"""Serving other workers: the holder side of a pull (the exporter, staging and pins), the KV a
prefill worker holds for a hand-off, and a decode worker's early pull while that prefill runs.
The puller's side is a tier of the engine (`workers.engine.tiering.peer`)."""
