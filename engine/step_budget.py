"""How many tokens one step may batch, so the streams already running keep flowing (`max_itl_ms`).

Every running stream waits for the whole step before it gets its next token, so a step that carries a long prefill chunk
is an inter-token gap for all of them. With a target gap set, the engine measures what a step costs per batched token
(an exponential moving average over the steps that carried prefill, the steps this budget sizes) and sizes the next
step to `target / cost_per_token` tokens, never above `max_num_batched_tokens` and never below the decodes plus
`min_prefill_tokens`, so waiting prompts always progress.

Why one ratio and not a fixed + per-token model: a step costs a + b*n, so a ratio measured on big steps underestimates
small ones; the next, smaller step then measures a higher ratio and the budget shrinks again. The fixed point of that
loop is the n where a + b*n equals the target, which is the size wanted. When the decodes alone exceed the target
(a >= target), the budget settles at its floor.

Without running decodes there is no stream to protect, but there may be a turn about to arrive: a step that carries
only background prefill (priority above 0, e.g. HTTP prompts) is sized to the target as well, so a Realtime turn that
arrives while it runs waits at most about one target for its own step. A step whose prefill is urgent (priority 0)
and that has no stream to protect gets the whole `max_num_batched_tokens` (best time to first token for the prompts).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepBudget:
    max_num_batched_tokens: int
    max_itl_ms: float | None = None        # None or 0: off, every step may batch max_num_batched_tokens
    min_prefill_tokens: int = 16           # floor on top of the decodes: prompts never stall completely
    ema_weight: float = 0.25               # weight of the newest step in the average
    seconds_per_token: float | None = None  # the moving average (None until a step with prefill was measured)

    @property
    def enabled(self) -> bool:
        return bool(self.max_itl_ms)

    def tokens(self, num_decodes: int, background_only: bool = False) -> int:
        """The step's token budget when `num_decodes` running streams each need one token; `background_only`: every
        prefill the step could carry is of a priority above 0."""
        full = self.max_num_batched_tokens
        if not self.max_itl_ms or (num_decodes == 0 and not background_only) or self.seconds_per_token is None:
            return full
        fit = int(self.max_itl_ms / 1000.0 / self.seconds_per_token)
        return min(full, max(fit, num_decodes + self.min_prefill_tokens))

    def observe(self, num_batched_tokens: int, seconds: float, carried_prefill: bool) -> None:
        """Feed one finished step (its batched tokens and wall time)."""
        if not carried_prefill or num_batched_tokens <= 0 or seconds <= 0:
            return
        x = seconds / num_batched_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = x if prev is None else prev + self.ema_weight * (x - prev)
