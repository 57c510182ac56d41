"""One response through the Realtime WebSocket: prefix reuse across turns, cancel and disconnect (the engine request
stops), context overflow (the oldest items leave the prompt), a turn rendered while another client's long prompt is
being tokenized. Real engine and model."""
from __future__ import annotations

import asyncio
import threading

import httpx
import orjson

from gateway.realtime.conversation import PromptRenderer
from tests.conftest import SMALL_CONTEXT
from tests.gateway.realtime.client import open_raw

LONG_TASK = "Write the numbers from 1 to 1000, separated by commas. Do not stop before 1000."
# The greedy reply to LONG_TASK counts on far past PROBE_TOKENS without ending its turn, on both kernel paths
# (RTSERVE_VNNI=1 and 0; a list the model may end early, such as "1 to 500", ended long before it on one of them).
# The probe in each abort test shows it on the path that runs, so a response that stops within ABORTED_WITHIN tokens of
# the cancel was stopped by the abort.
PROBE_TOKENS = 256
ABORTED_WITHIN = 96


async def test_prefix_reuse_across_turns(server):
    """Turn N's prompt is turn N-1's prompt + answer + the new user turn; only the new turn is prefilled."""
    block = server.engine.engine.args.block_size
    raw = await open_raw(server, max_output_tokens=16,
                         instructions="You are a helpful assistant who answers every question briefly. " * 8)
    previous = None
    for n, question in enumerate(["Tell me about the moon.", "What about the sun?", "And Mars?", "And Venus?"]):
        await raw.say(question)
        hits_before = server.stats()["prefix_cache_hits"]
        _, response, _ = await raw.respond()
        usage = response["usage"]
        cached = usage["input_token_details"]["cached_tokens"]
        assert server.stats()["prefix_cache_hits"] - hits_before >= cached
        if previous is not None:
            carried = previous["input_tokens"] + previous["output_tokens"]  # what the last turn left in the cache
            new_turn = usage["input_tokens"] - carried
            assert new_turn > 0
            # everything before the new turn is served from the cache, up to the last partial block
            assert cached >= (carried - 1) // block * block, (n, usage, previous)
            assert usage["input_tokens"] - cached <= new_turn + block
        previous = usage
    await raw.ws.close()
    await server.wait_idle()
    assert server.stats()["kv_pages_used"] == 0


async def probe_runs_long(raw) -> None:
    """The greedy reply to the session's one user item runs PROBE_TOKENS tokens without ending (out of band: the
    conversation is unchanged, and the prompt is the one the test's own response renders)."""
    item_id = raw.events[[e["type"] for e in raw.events].index("conversation.item.done")]["item"]["id"]
    _, probe, _ = await raw.respond({"conversation": "none", "temperature": 0, "max_output_tokens": PROBE_TOKENS,
                                     "input": [{"type": "item_reference", "id": item_id}]})
    assert probe["status"] == "incomplete" and probe["usage"]["output_tokens"] == PROBE_TOKENS, probe


async def first_text_delta(raw) -> list[dict]:
    events = [await raw.recv()]
    while events[-1]["type"] != "response.output_text.delta":
        events.append(await raw.recv())
    return events


async def start_long_reply(server):
    """A session whose greedy reply is known to run long (probe_runs_long), streaming its first text delta: (raw, the
    gauges before the session, the engine's generated-token total before the reply, the reply's events so far)."""
    base = await server.wait_idle()
    raw = await open_raw(server, max_output_tokens="inf")
    try:
        await raw.say(LONG_TASK)
        await probe_runs_long(raw)
        tokens = (await server.wait_idle())["generated_tokens_total"]
        await raw.send({"type": "response.create", "response": {"temperature": 0}})
        return raw, base, tokens, await first_text_delta(raw)
    except BaseException:
        await raw.ws.close()   # a failed test must not leave its session open for the registry checks of later ones
        raise


async def test_cancel_mid_stream_stops_the_engine_request(server):
    raw, base, tokens, events = await start_long_reply(server)
    try:
        live = server.stats()
        assert live["requests_running"] == 1, live  # still generating when the cancel goes out
        await raw.send({"type": "response.cancel", "event_id": "evt_cancel_1"})
        events += await raw.until("response.done")
        response = events[-1]["response"]
        assert response["status"] == "cancelled"
        assert response["status_details"]["reason"] == "client_cancelled"
        assert response["output"][0]["status"] == "incomplete"
        assert not [e for e in events if e["type"] == "error"]
        s = await server.wait_idle(pages_used=base["kv_pages_used"])  # aborted: nothing held, nothing pinned
        assert s["kv_pages_pinned"] == base["kv_pages_pinned"], (base, s)
        assert s["generated_tokens_total"] - tokens < ABORTED_WITHIN, s["generated_tokens_total"] - tokens
        # Cancel sent right behind its response.create (likely handled before the response task first runs).
        await raw.ws.send(orjson.dumps({"type": "response.create"}).decode())
        await raw.ws.send(orjson.dumps({"type": "response.cancel"}).decode())
        events = await raw.until("response.done")
        assert events[-1]["response"]["status"] == "cancelled"
        assert not [e for e in events if e["type"] == "error"]
        await server.wait_idle(pages_used=base["kv_pages_used"])
        # The session goes on; the cancelled partial answer stays in the conversation.
        await raw.say("Just say hello.")
        _, response, _ = await raw.respond({"max_output_tokens": 8})
        assert response["status"] in ("completed", "incomplete")
    finally:
        await raw.ws.close()


async def test_disconnect_mid_response_aborts(server):
    raw, base, tokens, _ = await start_long_reply(server)
    live = server.stats()
    await raw.ws.close()
    assert live["requests_running"] + live["requests_waiting"] == 1, live
    s = await server.wait_idle(pages_used=base["kv_pages_used"])
    assert s["kv_pages_pinned"] == base["kv_pages_pinned"], (base, s)
    assert s["generated_tokens_total"] - tokens < ABORTED_WITHIN, s["generated_tokens_total"] - tokens


async def chat_prompt_tokens(server, messages: list[dict]) -> int | None:
    """The prompt length of `messages` as the HTTP API renders them (the same model's chat template); None when the
    HTTP API refuses them for not fitting the model's context."""
    async with httpx.AsyncClient(timeout=120) as h:
        r = await h.post(f"{server.base_url}/chat/completions",
                         json={"model": server.engine.model_name, "max_tokens": 1, "messages": messages})
    if r.status_code == 400 and "does not fit" in r.json()["error"]["message"]:
        return None
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


async def test_context_overflow_drops_the_oldest_items(small_server):
    """A conversation longer than the model's context: the response still completes, on a prompt without the
    oldest items (OpenAI's `truncation: auto`); the items stay in the conversation."""
    server = small_server
    old, newer, question = "apple " * 500, "river " * 500, "Which word did I repeat?"
    raw = await open_raw(server, max_output_tokens=8, instructions="Be brief.")
    ids = [(await raw.say(text))["item"]["id"] for text in (old, newer, question)]
    system = [{"role": "system", "content": "Be brief."}]
    full = await chat_prompt_tokens(server, system + [{"role": "user", "content": t} for t in (old, newer, question)])
    assert full is None  # the whole conversation does not fit the context
    kept = await chat_prompt_tokens(server, system + [{"role": "user", "content": t} for t in (newer, question)])
    assert kept is not None and kept < SMALL_CONTEXT - 8
    _, response, events = await raw.respond()
    assert response["status"] in ("completed", "incomplete") and not [e for e in events if e["type"] == "error"]
    assert response["usage"]["input_tokens"] == kept, (response["usage"], kept)
    await raw.send({"type": "conversation.item.retrieve", "item_id": ids[0]})
    got = (await raw.until("conversation.item.retrieved"))[-1]
    assert got["item"]["content"][0]["text"] == old  # dropped from the prompt, not from the conversation
    # The next turn fits again in the same way.
    await raw.say("Thanks.")
    _, response, _ = await raw.respond()
    assert response["status"] in ("completed", "incomplete")
    assert response["usage"]["input_tokens"] < SMALL_CONTEXT
    await raw.ws.close()
    await server.wait_idle()


GATE_MARK = "rtserve-gate-7f3a"


class GatedBackend:
    """The tokenizer's own Rust backend, except that tokenizing a text holding GATE_MARK waits for `release` once it
    has begun (`entered`): the test holds a long prompt's tokenization open for as long as it needs, instead of racing
    a slow one."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self, texts) -> None:
        if any(GATE_MARK in t for t in texts):
            self.entered.set()
            assert self.release.wait(600)

    def encode_batch(self, texts, **kw):
        self.hold(texts)
        return self.backend.encode_batch(texts, **kw)

    def encode(self, text, *args, **kw):
        self.hold([text])
        return self.backend.encode(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.backend, name)


class GatedTokenizer:
    """The model's tokenizer with its backend gated (its `encode` too: the gate holds whichever path renders)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend_tokenizer = GatedBackend(tokenizer.backend_tokenizer)

    def encode(self, text, *args, **kw):
        self.backend_tokenizer.hold([text])
        return self.tokenizer.encode(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


async def test_a_turn_is_not_held_up_by_another_clients_prompt_being_tokenized(server):
    """A long HTTP prompt (under the byte and character caps, so it is tokenized) is held inside the tokenizer; a
    Realtime session meanwhile renders its turn and answers it, and only then does the HTTP prompt finish (refused by
    its token count). With one lock around the tokenizer, or tokenization on the event loop, the turn would wait."""
    state = server.app.state
    own = state.renderer
    gated = GatedTokenizer(own.tokenizer)
    state.renderer = PromptRenderer(gated)
    gate = gated.backend_tokenizer
    prompt = GATE_MARK + " " + " ".join(f"w{i % 997}" for i in range(80_000))
    try:
        async with httpx.AsyncClient(timeout=600) as h:
            http = asyncio.create_task(h.post(f"{server.base_url}/completions", json={
                "model": server.engine.model_name, "prompt": prompt, "max_tokens": 1}))
            while not gate.entered.is_set():   # the HTTP prompt is inside the tokenizer
                assert not http.done(), http.result().text
                await asyncio.sleep(0.05)
            raw = await open_raw(server, max_output_tokens=8)
            await raw.say("Say hi.")
            text, response, events = await raw.respond()
            assert response["status"] in ("completed", "incomplete") and text
            assert [e["type"] for e in events].index("response.created") < len(events) - 1
            assert not http.done()   # the turn was rendered and answered while the HTTP prompt was still held
            gate.release.set()
            r = await http
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        await raw.ws.close()
    finally:
        gate.release.set()
        state.renderer = own
    await server.wait_idle(pinned_ok=True)
