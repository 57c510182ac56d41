"""Running and finishing one response: from the user turn to `response.done`.

`ActiveResponse` is the state of the session's single active response (its params, engine request, item, status,
usage and output sink). `ResponseRunner` runs it: it waits for the user turn's transcripts, renders the prompt
(append-only against the session's `PromptHistory`, dropping the oldest items when it does not fit), adopts the reply
decoded during the pause when it is the same request, streams the engine's deltas into a `TextOutput` or an
`audio_out.AudioOutput` (through `function_calls.CallOutput` when the response's tools are active: text to the message
item, calls to `function_call` items), and finishes with the output item's done events and `response.done`. It also renders the reply
a pause may end with (`pregenerate`), so a reply decoded ahead and the response that adopts it are built alike.
`PromptHistory` owns the token ids the session has sent to the engine (last prompt + its answer), which the next turn
extends and a truncate rolls back.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from audio.stage import AudioStage
from engine import SamplingParams, StructuredOutputsParams
from engine.errors import EngineError, InvalidRequestError, PromptTooLongError
from gateway import memory
from gateway import tools as tl
from gateway.metrics import LatencyTimer, Metrics
from gateway.realtime import protocol as p
from gateway.realtime import session_config as sc
from gateway.realtime.audio_out import AudioOutput, SpeechPlan, output_format
from gateway.realtime.conversation import Conversation, Item, PromptRenderer, Rendered, to_messages
from gateway.realtime.function_calls import CallOutput
from gateway.realtime.speculation import Pregen

if TYPE_CHECKING:
    from gateway.realtime.audio_in import AudioInput
    from gateway.realtime.speculation import Speculation

log = logging.getLogger("rtserve.session")

REALTIME_PRIORITY = 0  # realtime turns run before HTTP batch requests (priority 1)


# The cancel reasons the OpenAI SDKs know; a response cut for another reason (a server shutdown) reports none.
CANCEL_REASONS = ("client_cancelled", "turn_detected")


def cancelled_details(reason: str | None) -> dict:
    return {"type": "cancelled", "reason": reason if reason in CANCEL_REASONS else None}


@dataclass(slots=True)
class ActiveResponse:
    id: str
    params: sc.ResponseParams
    request_id: str
    items: list[Item] | None  # the prompt's items when they are not the conversation (`input` given)
    output_modalities: list[str]
    task: asyncio.Task | None = None
    started: bool = False  # the task ran its first step (a task cancelled before that never runs its body)
    cancel_reason: str | None = None
    rendered: bool = False  # its prompt is rendered (a reply decoded ahead is taken or dropped by then)
    item: Item | None = None  # the message item being generated (None: not yet, or a response of calls only)
    out_items: list[Item] = field(default_factory=list)  # every output item, in output_index order
    status: str = "in_progress"
    status_details: dict | None = None
    usage: dict | None = None
    output: Any = None  # the sink streaming the message item (TextOutput | AudioOutput)
    # cancelled by a repair: the repaired turn's item, after which this reply's items leave the conversation once its
    # response.done is out (before it, its done events still name them)
    repaired: Item | None = None

    @property
    def in_conversation(self) -> bool:
        return self.params.conversation == "auto"

    @property
    def extends_session(self) -> bool:
        """Whether this turn continues the session's append-only prompt (and may pin its blocks)."""
        return self.in_conversation and self.items is None

    @property
    def audio_ms(self) -> int:
        """How much audio the response has sent (0 for text)."""
        return int(self.output.audio_ms) if isinstance(self.output, AudioOutput) else 0


class TextOutput:
    """Streams an `output_text` part: content_part.added → output_text.delta* → output_text.done/content_part.done."""

    def __init__(self, send: Callable[[dict], None], resp: ActiveResponse) -> None:
        self.send, self.resp = send, resp
        self.part = {"type": "output_text", "text": ""}
        resp.item.content.append(self.part)
        self._ids = {"response_id": resp.id, "item_id": resp.item.id, "output_index": resp.out_items.index(resp.item),
                     "content_index": 0}
        send({"type": "response.content_part.added", **self._ids, "part": {"type": "text", "text": ""}})

    def delta(self, text: str) -> None:
        self.part["text"] += text
        self.send({"type": "response.output_text.delta", **self._ids, "delta": text})

    def done(self) -> None:
        text = self.part["text"]
        self.send({"type": "response.output_text.done", **self._ids, "text": text})
        self.send({"type": "response.content_part.done", **self._ids, "part": {"type": "text", "text": text}})


@dataclass(slots=True)
class Turn:
    """The last turn that continued the session: its prompt, the ids generated (with their stop token, if any), and
    after a truncate the text of the answer still heard. Its text is decoded by the next render, in a worker thread
    (`rendered`): ending a turn and truncating one do no tokenizer work on the event loop."""
    item_id: str
    prompt: Rendered
    out_ids: list[int]
    kept: str | None = None
    _rendered: Rendered | None = None

    def rendered(self, renderer: PromptRenderer) -> Rendered:
        """The prompt the next turn extends: this turn's prompt plus its answer, or after a truncate the output tokens
        whose text is still in the item (a prefix-cache hit up to the cut, and no unheard text)."""
        if self._rendered is None:
            out_ids = self.out_ids
            if self.kept is not None:
                lo, hi = 0, len(out_ids)  # the longest k whose text is a prefix of what is kept
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self.kept.startswith(renderer.decode(out_ids[:mid])):
                        lo = mid
                    else:
                        hi = mid - 1
                out_ids = out_ids[:lo]
            self._rendered = renderer.extend(self.prompt, out_ids)
        return self._rendered


class PromptHistory:
    """The session's append-only prompt: the last turn that continued the session (`last`), which the next prompt
    extends and a truncate rolls back."""

    def __init__(self) -> None:
        self.last: Turn | None = None

    def extend(self, item_id: str, prompt: Rendered, out_ids: list[int]) -> None:
        self.last = Turn(item_id, prompt, list(out_ids))

    def rollback(self, item: Item) -> None:
        """After a truncate of the last answer: the next prompt keeps only the output tokens whose text is still in
        the item. Older items: the next render no longer extends `last` and re-renders in full."""
        if self.last is not None and self.last.item_id == item.id:
            self.last = Turn(item.id, self.last.prompt, self.last.out_ids, item.text())


class ResponseRunner:
    """Runs a session's responses (one at a time: the session holds the active one). `config()` is the session's
    current config; `stage` is None on a server without audio (replies are then text)."""

    def __init__(self, *, engine, renderer: PromptRenderer, metrics: Metrics, send: Callable[[dict], None],
                 conversation: Conversation, history: PromptHistory, config: Callable[[], dict],
                 dialect: str, stage: AudioStage | None, session_id: str, cache_salt: str | None,
                 max_output_tokens: int) -> None:
        self.engine, self.renderer, self.metrics, self.send = engine, renderer, metrics, send
        self.conversation, self.history, self.config, self.dialect = conversation, history, config, dialect
        self.stage = stage
        self.session_id, self.cache_salt, self.max_output_tokens = session_id, cache_salt, max_output_tokens
        self.stop_ids = stop_token_ids(engine.tokenizer)
        self.sentence_ends: frozenset[int] | None = None   # sentence_end_ids, found off the event loop at first use
        self.word_goes_on: frozenset[int] | None = None    # word_continuation_ids, likewise
        # the model's sampling defaults (--generation-config) the Realtime API has no field for (set by the app)
        self.sampling_defaults: dict = {}

    # ---------------------------------------------------------------------------------------- starting
    def announce(self, resp: ActiveResponse) -> None:
        """response.created, then the capacity clients pace by."""
        self.send({"type": "response.created", "response": self.response_dict(resp)})
        self._send_rate_limits()

    def _send_rate_limits(self) -> None:
        """No quotas here: report the engine's capacity (sequences, KV tokens) as the limits clients pace by."""
        stats = self.engine.stats()
        args = getattr(getattr(self.engine, "engine", None), "args", None)
        page = stats.get("kv_page_size", 1)
        seqs = getattr(args, "max_num_seqs", None) or getattr(self.engine, "max_num_seqs", 0)   # (a Router's: all)
        self.send({"type": "rate_limits.updated", "rate_limits": [
            {"name": "requests", "limit": seqs, "reset_seconds": 0.0,
             "remaining": max(0, seqs - stats.get("requests_running", 0) - stats.get("requests_waiting", 0))},
            {"name": "tokens", "limit": stats.get("kv_pages_total", 0) * page,
             "remaining": stats.get("kv_pages_free", 0) * page,
             "reset_seconds": 0.0}]})

    def response_dict(self, resp: ActiveResponse) -> dict:
        return {"id": resp.id, "object": "realtime.response", "status": resp.status,
                "status_details": resp.status_details,
                "output": [item.to_dict() for item in resp.out_items],
                "conversation_id": self.conversation.id if resp.in_conversation else None,
                "output_modalities": resp.output_modalities,
                "max_output_tokens": resp.params.max_output_tokens,
                "audio": {"output": {"format": self.config()["audio"]["output"]["format"],
                                     "voice": resp.params.voice}},
                "metadata": resp.params.metadata, "usage": resp.usage}

    # ---------------------------------------------------------------------------------------- the prompt
    async def _render(self, items: list[Item], instructions: str, extends_session: bool,
                      tools: tl.ToolRequest, response_items: list[Item] | None = None) -> tuple[Rendered, list[Item]]:
        """Render the prompt in a worker thread (templates and tokenizers are CPU work, and a big conversation must
        not hold up the other sessions), dropping the oldest items while it does not fit the model (OpenAI's
        `truncation: auto`); also returns the items rendered. `response_items`: the response's own `input`, if any
        (where a refusal points)."""
        turn = self.history.last if extends_session else None
        active = tools if tools.active else None
        truncate = self.config().get("truncation") != "disabled"
        prompt, items = await asyncio.to_thread(self._render_fitting, items, instructions, turn, active, truncate,
                                                response_items)
        if len(prompt.text) >= memory.BIG_BYTES or len(prompt.ids) >= memory.BIG_PROMPT_TOKENS:   # (free again)
            memory.release_soon()
        return prompt, items

    def _render_fitting(self, items: list[Item], instructions: str, turn: Turn | None, tools: tl.ToolRequest | None,
                        truncate: bool, response_items: list[Item] | None) -> tuple[Rendered, list[Item]]:
        """(In a worker thread.) A text longer than the context can hold tokens of is not tokenized at all: its
        oldest items go first, or it is refused (a conversation of large items would otherwise cost the tokenizer's
        working memory for millions of tokens)."""
        limit = self.engine.max_model_len - 1
        most_chars = self.engine.max_model_len * self.renderer.max_token_chars()
        previous = turn.rendered(self.renderer) if turn is not None else None
        while True:
            text = self.renderer.render_text(to_messages(items, instructions), tools)
            if len(text) > most_chars and truncate and len(items) > 1:
                items, previous = items[1:], None
                continue
            if len(text) > most_chars:
                raise PromptTooLongError(f"the conversation ({len(text)} characters) cannot fit the model's "
                                         f"{self.engine.max_model_len}-token context (at most {most_chars} "
                                         f"characters)", param=_too_long_param(items, response_items))
            prompt, _ = self.renderer.tokenize(text, previous)
            if len(prompt.ids) < limit or len(items) <= 1 or not truncate:
                return prompt, items
            items, previous = items[1:], None

    def _sampling(self, params: sc.ResponseParams, prompt: Rendered) -> SamplingParams:
        room = self.engine.max_model_len - len(prompt.ids)
        wanted = params.max_output_tokens
        max_tokens = min(room, self.max_output_tokens if wanted == "inf" else wanted)
        if max_tokens < 1:
            raise PromptTooLongError(f"the conversation ({len(prompt.ids)} tokens) leaves no room to answer "
                                     f"within the model's {self.engine.max_model_len}-token context")
        return SamplingParams(**self.sampling_defaults, max_tokens=max_tokens, temperature=params.temperature,
                              stop_token_ids=self.stop_ids, structured_outputs=params.tools.constraint())

    async def _check_tool_schemas(self, params: sc.ResponseParams) -> None:
        """Each active tool's `parameters` through the engine's grammar compiler (cached by schema): a schema it
        cannot compile fails the response with an error naming that tool, before anything reaches the engine."""
        if not params.tools.active:
            return
        names = [t.get("name") for t in params.tool_list]
        for t in params.tools.tools:
            try:
                await self.engine.compile_structured(StructuredOutputsParams(json=t["parameters"]))
            except InvalidRequestError as exc:
                index = names.index(t["name"]) if t["name"] in names else None
                where = f"{params.tools_param}[{index}]" if index is not None else params.tools_param
                raise InvalidRequestError(f"the parameters of tool {t['name']!r} cannot be compiled to a grammar: "
                                          f"{str(exc).split(': ', 1)[-1]}", param=f"{where}.parameters") from None

    async def pregenerate(self, transcript: str, score_end_of_turn: bool = False,
                          replaces: str | None = None) -> Pregen | None:
        """Start decoding the reply to a turn that may be ending (server VAD pause): the prompt the response would
        render if `transcript` were committed now. Nothing is sent; a response adopts it only if its prompt and
        sampling turn out identical (see `run`), otherwise it is aborted. `score_end_of_turn`: the prefill also scores
        the end-of-turn token after the user's words (turn_detection.py); `replaces`: the id of a user item this
        turn's speech continues (a repaired early end), left out since `transcript` holds all of it."""
        config = self.config()
        params = sc.response_params(config, None, self.dialect)
        pending = Item("pending", "message", role="user", content=[{"type": "input_audio", "transcript": transcript}])
        settled = [it for it in self.conversation.items  # this turn's item, if committed already, is `pending`
                   if it.id != replaces and not any(part.get("transcript", "") is None for part in it.content)]
        try:
            prompt, _ = await self._render([*settled, pending], params.instructions, True, params.tools)
            sampling = self._sampling(params, prompt)
        except PromptTooLongError:
            return None
        scored = end_of_turn_positions(prompt.ids, self.stop_ids, self.engine.tokenizer.decode) \
            if score_end_of_turn else []
        if scored:
            sampling.prompt_logprob_positions = scored
            sampling.prompt_logprobs = SENTENCE_END_TOP
            if self.sentence_ends is None:
                self.sentence_ends = await asyncio.to_thread(sentence_end_ids, self.engine.tokenizer,
                                                             tuple(self.stop_ids))
            if self.word_goes_on is None:
                self.word_goes_on = await asyncio.to_thread(word_continuation_ids, self.engine.tokenizer)
        speech = None
        # the reply will be spoken: start on it (not when it may call a tool: its text is parsed first, by the
        # response, so no call is ever spoken)
        if self.stage is not None and params.output_modalities == ["audio"] and not params.tools.active:
            speech = SpeechPlan(self.stage, *output_format(config))
        return Pregen(self.engine, f"{self.session_id}-{p.new_id('pre')}", prompt, sampling, speech=speech,
                      eot_positions=scored, sentence_end_ids=self.sentence_ends or frozenset(),
                      continuation_ids=self.word_goes_on or frozenset(),
                      priority=REALTIME_PRIORITY, cache_salt=self.cache_salt, session_id=self.session_id)

    def open_sink(self, resp: ActiveResponse):
        """The sink that turns `resp.item`'s text deltas into events: spoken when the response's modalities are
        ["audio"]."""
        if self.stage is not None and resp.output_modalities == ["audio"]:
            return AudioOutput(self.send, resp, self.stage, *output_format(self.config()),
                               name=f"{self.session_id}-{resp.id}")
        return TextOutput(self.send, resp)

    # ---------------------------------------------------------------------------------------- running
    async def run(self, resp: ActiveResponse, audio_in: AudioInput | None, speculation: Speculation | None) -> None:
        """Run `resp` up to its response.done, which the session sends (CancelledError comes out only when the
        session is closing). `audio_in`: the session's input side, whose committed speech is this turn's prompt;
        `speculation`: where a reply decoded during the pause that ended the turn waits."""
        resp.started = True
        finished, out_ids, n_prompt, n_cached = False, [], 0, 0
        prompt = None
        output = None
        try:
            if audio_in is not None and resp.items is None:  # the committed speech is this turn's prompt
                await audio_in.wait_transcripts()  # (commits sent before response.create already ran)
            items = list(resp.items if resp.items is not None else self.conversation.items)
            await self._check_tool_schemas(resp.params)
            prompt, rendered = await self._render(items, resp.params.instructions, resp.extends_session,
                                                  resp.params.tools, resp.items)
            try:
                sampling = self._sampling(resp.params, prompt)
            except PromptTooLongError as exc:
                exc.param = _too_long_param(rendered, resp.items)
                raise
            pre = speculation.take_reply() if speculation is not None else None
            resp.rendered = True
            if pre is not None and not (resp.extends_session and pre.matches(prompt, sampling)):
                pre.cancel()
                pre = None
            if resp.params.tools.active:  # text and calls: the items open as the parser finds them
                output = CallOutput(self, resp)
            else:
                resp.item = Item(p.new_id("item"), "message", role="assistant", status="in_progress")
                self.add_output_item(resp, resp.item)
                output = resp.output = self.open_sink(resp)
            loop = asyncio.get_running_loop()
            timer = LatencyTimer(self.metrics, "realtime", loop.time())
            if pre is not None:  # decoded during the pause that ended the turn: same prompt, same sampling
                self.stage.speculations["adopted"] += 1
                spoken = pre.take_speech(*((output.fmt, output.speed) if isinstance(output, AudioOutput)
                                           else (None, 0.0)))
                if spoken:
                    self.stage.speculations["spoken"] += len(spoken)
                    output.adopt(spoken)
                resp.request_id = pre.request_id
                gen = pre.stream()
            else:
                gen = self.engine.generate(resp.request_id, prompt.ids, sampling, priority=REALTIME_PRIORITY,
                                           cache_salt=self.cache_salt,
                                           session_id=self.session_id if resp.extends_session else None)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    out_ids.extend(out.new_token_ids)
                    n_prompt, n_cached = out.num_prompt_tokens, out.num_cached_tokens
                    if out.text_delta:
                        timer.mark(loop.time())
                        output.delta(out.text_delta)
                    if out.finished:
                        finished = True
                        if out.finish_reason == "length":
                            resp.status = "incomplete"
                            resp.status_details = {"type": "incomplete", "reason": "max_output_tokens"}
                        elif out.finish_reason == "abort":
                            resp.status = "cancelled"
                            resp.status_details = {"type": "cancelled", "reason": "client_cancelled"}
                        else:
                            resp.status = "completed"
                            resp.status_details = None
            if isinstance(output, (AudioOutput, CallOutput)):
                await output.finish()  # the rest of the reply is spoken before response.done
        except asyncio.CancelledError:
            if isinstance(output, (AudioOutput, CallOutput)):
                output.cancel()
            if not finished:
                await self._abort(resp.request_id)
            if resp.cancel_reason is None:  # the session is closing: nobody to tell
                raise
            resp.status = "cancelled"
            resp.status_details = cancelled_details(resp.cancel_reason)
        except (PromptTooLongError, InvalidRequestError) as exc:
            if exc.param and not exc.param.startswith("structured_outputs"):  # the client's input: say where
                self.send(p.error_event(p.ProtocolError(str(exc), _error_code(exc), exc.param)))
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "invalid_request_error",
                                                               "code": type(exc).__name__, "message": str(exc)}}
        except EngineError as exc:
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "server_error", "code": "engine_error",
                                                               "message": str(exc)}}
        except Exception as exc:
            log.exception("response %s failed", resp.id)
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "server_error", "code": None,
                                                               "message": f"internal error: {exc}"}}
        self.finish(resp, prompt, output, out_ids, n_prompt, n_cached)

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.engine.abort(request_id))

    # ---------------------------------------------------------------------------------------- finishing
    def finish(self, resp: ActiveResponse, prompt: Rendered | None, output, out_ids: list[int], n_prompt: int,
               n_cached: int) -> None:
        """The output item's done events, the session's prompt history extended by this turn, the usage; the session
        then sends response.done (`send_done`) once it no longer holds the response as active."""
        if isinstance(output, CallOutput):
            output.done()
        elif resp.item is not None:
            if output is not None:
                output.done()
            self.close_output_item(resp, resp.item, "completed" if resp.status == "completed" else "incomplete")
        if resp.extends_session and prompt is not None and resp.out_items:
            self.history.extend((resp.item or resp.out_items[0]).id, prompt, out_ids)
        n_out = len(out_ids)
        resp.usage = {"total_tokens": n_prompt + n_out, "input_tokens": n_prompt, "output_tokens": n_out,
                      "input_token_details": {"text_tokens": n_prompt, "audio_tokens": 0, "image_tokens": 0,
                                              "cached_tokens": n_cached,
                                              "cached_tokens_details": {"text_tokens": n_cached,
                                                                        "audio_tokens": 0, "image_tokens": 0}},
                      "output_token_details": {"text_tokens": n_out, "audio_tokens": 0}}

    def add_output_item(self, resp: ActiveResponse, item: Item) -> None:
        """A new output item: response.output_item.added, and into the conversation unless out of band."""
        resp.out_items.append(item)
        self.send({"type": "response.output_item.added", "response_id": resp.id,
                   "output_index": len(resp.out_items) - 1, "item": item.to_dict()})
        if resp.in_conversation:
            before = self.conversation.insert(item)
            self.send({"type": "conversation.item.added", "previous_item_id": before, "item": item.to_dict()})

    def close_output_item(self, resp: ActiveResponse, item: Item, status: str) -> None:
        """response.output_item.done, and conversation.item.done while the item is still in the conversation."""
        item.status = status
        done = item.to_dict()
        self.send({"type": "response.output_item.done", "response_id": resp.id,
                   "output_index": resp.out_items.index(item), "item": done})
        if resp.in_conversation and item.id in self.conversation:
            index = next(i for i, it in enumerate(self.conversation.items) if it.id == item.id)
            before = self.conversation.items[index - 1].id if index else None
            self.send({"type": "conversation.item.done", "previous_item_id": before, "item": done})

    def send_done(self, resp: ActiveResponse) -> None:
        self.send({"type": "response.done", "response": self.response_dict(resp)})


def _too_long_param(items: list[Item], response_items: list[Item] | None) -> str | None:
    """Where a prompt that cannot fit comes from, when one function call item alone is too long for the context
    (its arguments or output); None otherwise (a long conversation is the session's state, not one bad field)."""
    if len(items) != 1 or items[0].type == "message":
        return None
    field_name = "arguments" if items[0].type == "function_call" else "output"
    if response_items is not None:
        return f"response.input[{response_items.index(items[0])}].{field_name}"
    return f"item.{field_name}"


def _error_code(exc: Exception) -> str:
    return "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "invalid_value"


def end_of_turn_position(ids: list[int], stop_ids: list[int]) -> int | None:
    """Where the template closes the last user message (its end-of-turn token, right after the user's last word);
    the assistant header that follows holds none."""
    stops = set(stop_ids)
    return next((i for i in range(len(ids) - 1, 0, -1) if ids[i] in stops), None)


def end_of_turn_positions(ids: list[int], stop_ids: list[int], decode) -> list[int]:
    """The positions whose tokens' joint logprob is P(the turn ends here | the words before): the end-of-turn token
    and the sentence punctuation Whisper put right before it. Whisper guesses a final "?" or "." from the words, so
    "What is the capital of?" must count as the unlikely end it is: P("?" | "...capital of") is what says so."""
    eot = end_of_turn_position(ids, stop_ids)
    if eot is None:
        return []
    start = eot
    while start > 1 and (piece := decode([ids[start - 1]]).strip()) and all(c in ".?!,;:…" for c in piece):
        start -= 1
    return list(range(start, eot + 1))[-16:]


# the top logprobs asked for at the end-of-turn positions: the sentence-end tokens that matter rank among them
SENTENCE_END_TOP = 20


@functools.cache
def sentence_end_ids(tokenizer, stop_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a sentence right after a word: ".", "?", "!" alone or repeated (with or without a leading
    space), and the end-of-turn tokens. Their share of the distribution after the user's last word is P(a sentence
    ends there) (turn_detection.combine). Found once per tokenizer, among the tokens of the vocabulary that hold one
    of those characters."""
    candidates = [i for t, i in tokenizer.get_vocab().items() if any(c in t for c in ".?!")]
    ends = {i for i in candidates
            if (s := tokenizer.decode([i]).strip()) and len(s) <= 3 and all(c in ".?!" for c in s)}
    return frozenset(ends | set(stop_ids))


@functools.cache
def word_continuation_ids(tokenizer) -> frozenset[int]:
    """The tokens that go on with the word before them rather than start a new one or end it: those whose text begins
    with an ASCII letter or digit, or an apostrophe before a letter ("Juliet" -> "te", "'s"). Their share of the
    distribution after the user's last word is the model's doubt that the word is over (turn_detection.at_word_end).
    Scripts without spaces between words (and letters outside ASCII) are left out: there, a word's end cannot be read
    off a token's first character."""
    goes_on = set()
    for i in tokenizer.get_vocab().values():
        s = tokenizer.decode([i])
        if s and s.isascii() and (s[0].isalnum() or (s[0] == "'" and s[1:2].isalpha())):
            goes_on.add(i)
    return frozenset(goes_on)


def stop_token_ids(tokenizer) -> list[int]:
    """EOS plus the chat template's end-of-turn token, so answers end where the template closes a message."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)
