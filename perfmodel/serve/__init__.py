"""Serving simulation: arrivals, continuous batching over paged KV blocks, prefill and decode
pools, with step costs from the engines (docs/serving.md)."""
