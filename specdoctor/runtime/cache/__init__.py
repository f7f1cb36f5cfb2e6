"""What a decode keeps between steps: the KV cache, linear-attention states, and regrouping batch rows."""
