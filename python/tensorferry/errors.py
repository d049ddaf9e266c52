"""Exceptions raised by tensorferry, one class per kind of failure.

Every class derives from :class:`TensorferryError` and from the built-in exception that
fits, so ``except FileNotFoundError`` and ``except ValueError`` keep working.
"""


class TensorferryError(Exception):
    """Base class of every tensorferry error."""


class NotFoundError(TensorferryError, FileNotFoundError):
    """A file (or object) does not exist."""


class PermissionDeniedError(TensorferryError, PermissionError):
    """A file exists but may not be read or written."""


class InvalidFileError(TensorferryError, ValueError):
    """A file is not valid safetensors, index or raw data of the size asked for."""


class TensorNotFoundError(TensorferryError, KeyError):
    """A named tensor is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else ""


class ReadError(TensorferryError, OSError):
    """An operating-system error while reading or writing, or a file shorter than planned."""


class WriteError(ReadError):
    """An operating-system error while writing (``errno`` says which: ``ENOSPC`` when the
    disk is full, ...). A :class:`ReadError` too, so that code catching I/O errors of
    tensorferry catches both."""


class InvalidArgumentError(TensorferryError, ValueError):
    """Arguments that do not fit together (sizes, dtypes, devices, options)."""


class UnsupportedError(TensorferryError, RuntimeError):
    """This machine lacks what the request needs (no CUDA driver, ...)."""


class CudaError(TensorferryError, RuntimeError):
    """The CUDA driver reported an error."""


class OutOfMemoryError(TensorferryError, MemoryError):
    """Host or device memory could not be allocated."""


class CancelledError(TensorferryError):
    """The operation was cancelled."""


__all__ = [
    "TensorferryError", "NotFoundError", "PermissionDeniedError", "InvalidFileError",
    "TensorNotFoundError", "ReadError", "WriteError", "InvalidArgumentError", "UnsupportedError",
    "CudaError", "OutOfMemoryError", "CancelledError",
]
