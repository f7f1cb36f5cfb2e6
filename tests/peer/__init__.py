"""The peer suite: vLLM's CPU build as an oracle we did not write (tokens, acceptance counts, its own
helper functions) and as a live deployment for `specdoctor probe`."""
