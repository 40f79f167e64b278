"""Stage workers: per-stage model shard, KV cache, input preparation and sampling."""
