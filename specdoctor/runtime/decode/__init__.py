"""Decoding across pipeline ranks: requests, the pipeline pass, batch state, the speculative step, rejection
sampling, sampling, log-probabilities, metrics and continuous batching."""
