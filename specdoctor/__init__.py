"""specdoctor: find and repair silent failures in speculative-decoding deployments."""

__version__ = "0.1.0"
