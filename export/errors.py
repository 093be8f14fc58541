"""The errors ``python -m export`` reports as one line, kept in a module with no heavy imports so
that the command line can name them (and print ``--help``) without loading torch or onnx."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and field at fault."""


class VerificationError(RuntimeError):
    """An exported graph disagrees with its PyTorch reference."""


class EngineBuildError(RuntimeError):
    """An engine could not be built; the message names the graph and the reason."""
