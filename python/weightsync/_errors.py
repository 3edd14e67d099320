"""weightsync.Error: the library's one error type, as a Python exception."""


class Error(RuntimeError):
    """A weightsync error: `.code` is the library's error code and the message
    names the tensor, key, rank or peer involved and what was expected.

    Codes: invalid_argument, invalid_layout, format, io, mismatch, not_found,
    timeout, peer_failure, transport, protocol, unsupported, cancelled,
    internal.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # picklable across processes (multiprocessing, futures)
        return (type(self), (self.code, self.message))

    def __repr__(self) -> str:
        return f"weightsync.Error(code={self.code!r}, message={self.message!r})"
