"""The model and its decode loop: loading, the one place that knows architectures, the
position-carrying KV cache, the attention function, and the engine that yields one event
per step into a trace. Knows nothing of SkipDecode or KV eviction beyond the plan and the
policy objects the engine is handed."""
