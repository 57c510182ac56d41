"""Per-request sampling settings, validated up front so a bad value fails the request, never the engine step."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError


@dataclass(slots=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's names); exactly one field is set. Compiled and enforced by
    engine/structured_output.py."""
    json: dict | str | None = None        # a JSON schema (dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None       # the output is exactly one of these strings
    grammar: str | None = None            # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None       # any JSON object
    structural_tag: dict | str | None = None   # xgrammar structural tag (free text + tagged, schema-bound regions)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "structured_outputs") -> None:
        def bad(name: str, why: str):
            raise InvalidRequestError(f"invalid {prefix}.{name}: {why}" if name else f"invalid {prefix}: {why}",
                                      param=f"{prefix}.{name}" if name else prefix)

        set_ = self._set_fields()
        if len(set_) != 1:
            bad("", f"exactly one of json, regex, choice, grammar, json_object, structural_tag must be set, "
                    f"got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad("json", f"must be a JSON schema object or its JSON text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, "must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            bad("choice", "must be a non-empty list of non-empty strings")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            bad("structural_tag", f"must be a structural tag object or its JSON text, got "
                                  f"{type(self.structural_tag).__name__}")
        if self.json_object not in (None, True, False):
            bad("json_object", f"must be a boolean, got {self.json_object!r}")

    def _set_fields(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._set_fields()[0]

    @classmethod
    def from_dict(cls, d: Any, prefix: str = "structured_outputs") -> StructuredOutputsParams:
        if not isinstance(d, dict):
            raise InvalidRequestError(f"invalid {prefix}: must be an object", param=prefix)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"invalid {prefix}: unknown field {unknown[0]!r} (expected one of "
                                      f"{sorted(known)})", param=f"{prefix}.{unknown[0]}")
        obj = cls.__new__(cls)
        for f in fields(cls):
            setattr(obj, f.name, d.get(f.name))
        obj.validate(prefix)
        return obj


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0 = greedy
    top_k: int = -1                   # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0   # HF style, over prompt + output
    frequency_penalty: float = 0.0    # OpenAI style, over output
    presence_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0               # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    logprobs: int | None = None       # top-n logprobs per output token (of the raw model distribution)
    # prompt positions whose token's logprob (given the prompt before it) comes back in RequestOutput.prompt_logprobs:
    # vLLM's prompt_logprobs, for a few chosen positions, computed in the prefill's own forward pass
    prompt_logprob_positions: list[int] | None = None
    # and the top-n logprobs of the distribution at each of them (RequestOutput.prompt_top_logprobs), as vLLM's
    # prompt_logprobs count gives them: what else the model expected there
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None   # grammar-constrained decoding

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidRequestError(f"invalid stop: must be a string or a list of strings, got "
                                      f"{type(self.stop).__name__}", param="stop")
        self.stop = [s for s in (self.stop or []) if s != ""]
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset, type(None))):
            raise InvalidRequestError("invalid stop_token_ids: must be a list of integers", param="stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(param: str, why: str):
            raise InvalidRequestError(f"invalid {param}: {why}", param=param)

        for name in ("max_tokens", "top_k", "min_tokens"):   # ints the sampler puts in int64 tensors
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not -2**31 < v < 2**31:
                bad(name, f"must be an integer below 2**31, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                bad(name, f"must be a number, got {v!r}")
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop", "must be a string or a list of strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)):
            bad("logprobs", f"must be an integer, got {self.logprobs!r}")
        positions = self.prompt_logprob_positions
        if positions is not None and (not isinstance(positions, (list, tuple)) or len(positions) > 16 or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in positions)):
            bad("prompt_logprob_positions", "must be a list of at most 16 integers >= 1 (position 0 has no logprob)")
        top = self.prompt_logprobs
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {top!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", f"must be StructuredOutputsParams, got "
                                          f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
