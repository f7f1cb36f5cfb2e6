"""User-facing errors: the CLI prints their message as one line and exits 2."""


class SpecdoctorError(Exception):
    """Bad input or usage that the user can fix; never shown with a traceback."""


class CheckpointError(SpecdoctorError):
    """A checkpoint directory, index, shard or tensor that cannot be used as given."""


class PipelineError(SpecdoctorError):
    """A pipeline rank died, hung past the timeout, or failed."""
