"""Typed errors: each names the problem so the gateway can turn it into an OpenAI-shaped error."""


class EngineError(Exception):
    """Base class for everything the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine can never serve as given (bad sampling values, empty prompt, unknown token ids)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus room for one output token) exceeds the model context or the whole KV pool."""


class ModelLoadError(EngineError):
    """The model path does not exist, or names an architecture we do not implement."""


class EngineDeadError(EngineError):
    """The engine shut down, or stopped on a fault in a step that could not be pinned on any request (then
    `AsyncEngine.healthy` is False and `AsyncEngine.error` says why)."""


class RequestFailedError(EngineError):
    """An engine step raised on this request's account (its sampling, grammar or detokenization, or a forward pass
    that fails whenever it is in the batch): it alone was failed, the other requests of the step go on."""
