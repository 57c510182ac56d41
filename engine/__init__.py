"""rtserve's inference engine: paged KV cache, continuous batching, prefix caching (see docs/engine-api.md)."""
from engine.config import EngineArgs, parse_size
from engine.errors import (EngineDeadError, EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError,
                           RequestFailedError)
from engine.llm_engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):
    if name == "AsyncEngine":   # lazy: keeps `import engine` light for tools that only need the offline API
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams",
           "EngineError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError", "EngineDeadError",
           "RequestFailedError", "parse_size"]
