"""User-facing error types.

Every error a user can cause (a bad checkpoint path, an invalid sampling value, a prompt that
does not fit) raises a subclass of `MetraleError`. Each carries the HTTP status and the OpenAI
error `type` that `serving` puts into `{"error": {"message", "type", "param", "code"}}`, and the
CLI turns it into a one-line message with exit code 2.
"""

from __future__ import annotations


class MetraleError(Exception):
    """Base class of all errors caused by the user's input or files.

    Attributes:
        message: one human-readable sentence saying what is wrong.
        status: the HTTP status the server answers with.
        error_type: OpenAI's error `type` string.
        param: the request parameter at fault, if any.
        code: OpenAI's optional machine-readable error code.
    """

    status: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidParameterError(MetraleError):
    """A request or sampling parameter has a wrong type or is out of range."""


class MemoryPlanError(InvalidParameterError):
    """The params and the requested KV cache do not fit in the devices' memory (or the memory
    is unknown and nothing says how large the cache may be). Raised before anything is
    allocated; the message gives the numbers per device."""

    def __init__(self, message: str, *, param: str | None = "memory_gb"):
        super().__init__(message, param=param, code="insufficient_memory")


class CheckpointError(MetraleError):
    """A checkpoint is missing, truncated, corrupt or disagrees with its config.

    The message always names the offending file.
    """

    status = 400
    error_type = "invalid_request_error"


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or tensor type is not one Metrale-JAX implements."""


class ChatTemplateError(MetraleError):
    """The model has no chat template, or its template raised while rendering."""


class ContextLengthError(MetraleError):
    """A prompt plus its requested tokens does not fit in the model's context."""

    def __init__(self, message: str, *, param: str | None = "messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


class ModelNotFoundError(MetraleError):
    """A model name or path that resolves to no checkpoint (HTTP 400, as the API spec asks)."""

    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class FetchError(MetraleError):
    """The default model could not be fetched (registry unreachable or bad checksum)."""

    status = 503
    error_type = "server_error"


class BusyError(MetraleError):
    """The waiting queue is full or the server is draining: retry later (HTTP 503)."""

    status = 503
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message, code="server_busy")
        self.retry_after = retry_after


class PeerLostError(MetraleError):
    """Another process of a multi-host server died or cut its connection: the collective
    programs cannot run without it, so in-flight requests fail and this process exits
    (HTTP 503)."""

    status = 503
    error_type = "server_error"

    def __init__(self, message: str):
        super().__init__(message, code="peer_lost")
