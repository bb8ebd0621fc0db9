"""The CPU side: requests, KV blocks, batching policy, packing, client traffic."""
