"""`specdoctor serve`: an OpenAI-compatible HTTP server over the pipeline runtime."""
