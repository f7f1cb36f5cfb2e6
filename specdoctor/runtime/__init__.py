"""The pipeline-parallel runtime: checkpoint reading, model, drafter loading, speculative decoding."""
