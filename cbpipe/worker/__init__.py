"""The GPU side: model, paged KV cache, streams and events, carry-over, sampling."""
