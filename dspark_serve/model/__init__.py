"""The target model: its decoder forward, weight loading, (quantised) linear layers and the
per-request KV cache the forward reads and writes."""
