"""Protocol-level unit tests (no engine): handshake rules, session updates, dialect translation, prompt rendering."""
from __future__ import annotations

import pytest
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GAServerEvent
from pydantic import TypeAdapter

from gateway import protocol as p
from gateway import session_config as sc
from gateway.conversation import Conversation, Item, PromptRenderer, parse_item, to_messages
from gateway.handshake import negotiate

GA_EVENTS, BETA_EVENTS = TypeAdapter(GAServerEvent), TypeAdapter(BetaServerEvent)


@pytest.mark.parametrize("offered, expected", [([], None), (["realtime"], "realtime"),
                                               (["realtime", "openai-insecure-api-key.k"], "realtime"),
                                               (["openai-insecure-api-key.k"], None)])
def test_subprotocol_echoed_only_when_offered(offered, expected):
    assert negotiate({}, {}, offered, None, None).subprotocol == expected


def test_auth_and_dialect():
    assert negotiate({}, {}, [], "k", None).reject[0] == 401
    assert negotiate({}, {}, ["openai-insecure-api-key.k"], "k", None).reject is None
    assert negotiate({"authorization": "Bearer k"}, {}, [], "k", None).reject is None
    assert negotiate({}, {"api-key": "k"}, [], "k", None).reject is None
    assert negotiate({"authorization": "Bearer x"}, {}, [], "k", None).reject[0] == 401
    assert negotiate({"openai-beta": "realtime=v1"}, {}, [], None, None).dialect == p.BETA
    assert negotiate({}, {}, ["realtime", "openai-beta.realtime-v1"], None, None).dialect == p.BETA
    assert negotiate({}, {"model": "m"}, [], None, None).dialect == p.GA
    assert negotiate({"origin": "http://a.example", "host": "b:1"}, {}, [], None, None).reject[0] == 403
    assert negotiate({"origin": "http://a.example", "host": "b"}, {}, [], None, ["http://a.example"]).reject is None
    assert negotiate({"origin": "http://b:1", "host": "b:1"}, {}, [], None, None).reject is None


def session_event(session: dict, dialect: str) -> dict:
    return {"type": "session.updated", "event_id": p.new_id("event"), "session": sc.render(session, dialect)}


def test_session_update_partial_and_atomic():
    s = sc.default_session("sess_x", "SmolLM2")
    GA_EVENTS.validate_python(session_event(s, p.GA), strict=True)
    BETA_EVENTS.validate_python(session_event(s, p.BETA), strict=True)
    s2 = sc.apply_update(s, {"type": "realtime", "instructions": "hi", "audio": {"input": {"turn_detection": None},
                                                                               "output": {"voice": "marin"}}}, p.GA)
    assert s2["instructions"] == "hi" and s2["audio"]["input"]["turn_detection"] is None
    assert s2["audio"]["output"]["voice"] == "marin" and s2["audio"]["output"]["speed"] == 1.0
    assert s2["output_modalities"] == ["audio"]
    GA_EVENTS.validate_python(session_event(s2, p.GA), strict=True)
    with pytest.raises(p.ProtocolError) as info:  # one bad field: nothing applied
        sc.apply_update(s2, {"instructions": "new", "audio": {"output": {"speed": 9}}}, p.GA)
    assert info.value.param == "session.audio.output.speed"
    b = sc.apply_update(s, {"modalities": ["text"], "input_audio_format": "g711_ulaw", "temperature": 1.0,
                            "turn_detection": {"type": "semantic_vad", "eagerness": "low"}}, p.BETA)
    assert b["output_modalities"] == ["text"] and b["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    rendered = sc.render(b, p.BETA)
    assert rendered["input_audio_format"] == "g711_ulaw" and rendered["turn_detection"]["eagerness"] == "low"
    BETA_EVENTS.validate_python(session_event(b, p.BETA), strict=True)
    with pytest.raises(p.ProtocolError) as info:
        sc.apply_update(s, {"temperature": 3}, p.BETA)
    assert info.value.code == "invalid_value"


def test_dialect_translation_of_events():
    item = {"id": "item_1", "object": "realtime.item", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hi"}]}
    ev = {"type": "conversation.item.added", "event_id": "event_1", "previous_item_id": None, "item": item}
    beta = p.to_dialect(ev, p.BETA)
    assert beta["type"] == "conversation.item.created" and beta["item"]["content"][0]["type"] == "text"
    BETA_EVENTS.validate_python(beta, strict=True)
    assert p.to_dialect({"type": "conversation.item.done", "item": item}, p.BETA) is None
    assert p.to_dialect({"type": "response.output_text.delta"}, p.BETA)["type"] == "response.text.delta"
    assert p.to_dialect(ev, p.GA) is ev


def test_frame_parsing_errors():
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame(b"\xff")
    assert info.value.code == "invalid_json"
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame('{"type": 3, "event_id": "e"}')
    assert (info.value.code, info.value.param, info.value.event_id) == ("invalid_type", "type", "e")
    err = p.error_event(p.ProtocolError("m", "c", "x"), "evt")
    GA_EVENTS.validate_python(err, strict=True)
    assert err["error"]["event_id"] == "evt"
    assert p.new_id("resp").startswith("resp_") and len(p.new_id("resp")) == 27


def test_items_and_conversation_order():
    conv = Conversation()
    a = parse_item({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]})
    b = parse_item({"id": "b", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "b"}]})
    assert conv.insert(a) is None and conv.insert(b) == a.id
    c = Item("c", "message", role="system", content=[{"type": "input_text", "text": "c"}])
    assert conv.insert(c, "root") is None and [i.id for i in conv.items] == ["c", a.id, "b"]
    assert b.content[0]["type"] == "output_text"
    with pytest.raises(p.ProtocolError):
        parse_item({"type": "message", "role": "system", "content": [{"type": "output_text", "text": "x"}]})
    assert to_messages(conv.items, "") == [{"role": "system", "content": "c"}, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}]


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from engine.models.loader import resolve_model_dir

    return PromptRenderer(AutoTokenizer.from_pretrained(resolve_model_dir(None)))


@pytest.mark.parametrize("instructions", ["", "Be brief."])
def test_rendering_is_append_only(renderer, instructions):
    """Turn 2 extends turn 1's prompt + answer exactly, with or without the template's default system prompt."""
    tok = renderer.tokenizer
    msgs = [{"role": "user", "content": "Hello there"}]
    prompt, extended = renderer.render(to_messages_of(msgs, instructions))
    assert not extended and prompt.ids == tok.encode(prompt.text, add_special_tokens=False)
    answer = "Hi! How can I help?"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for output_ids in (tok.encode(answer, add_special_tokens=False) + [end],  # stopped on end-of-turn
                       tok.encode(answer, add_special_tokens=False)):  # cut by max tokens
        state = renderer.extend(prompt, output_ids)
        msgs2 = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me more"}]
        prompt2, extended = renderer.render(to_messages_of(msgs2, instructions), state)
        assert extended and prompt2.ids[:len(state.ids)] == state.ids
        assert tok.decode(prompt2.ids) == prompt2.text
    # A rewritten history (different first message) falls back to a full re-render.
    prompt3, extended = renderer.render(to_messages_of([{"role": "user", "content": "Other"}], instructions), state)
    assert not extended


def to_messages_of(msgs: list[dict], instructions: str) -> list[dict]:
    return ([{"role": "system", "content": instructions}] if instructions else []) + msgs


def test_cli_flags_map_to_engine_args(capsys):
    from gateway import cli

    ns = cli.serve_parser().parse_args(["--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--no-prefix-caching",
                                        "--port", "9000", "--api-key", "k"])
    assert cli.engine_args(ns) == {"kv_cache_memory": "2GiB", "max_num_seqs": 8, "enable_prefix_caching": False,
                                   "dtype": "bfloat16",   # the server's default; the engine API's stays float32
                                   "quantization": "gguf"}   # the embedded model is a Q4_1 GGUF: decode on its blocks
    assert cli.engine_args(cli.serve_parser().parse_args(["--dtype", "float32"]))["dtype"] == "float32"
    assert cli.engine_args(cli.serve_parser().parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in cli.engine_args(cli.serve_parser().parse_args([]))
    assert cli.engine_args(cli.serve_parser().parse_args(["--quantization", "none"]))["quantization"] is None
    assert cli.engine_args(cli.serve_parser().parse_args(["--model", "/m/hf-dir"]))["quantization"] is None
    assert (ns.port, ns.api_key, ns.host) == (9000, "k", "127.0.0.1")
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert cli.main([]) == 2 and "rtserve serve" in capsys.readouterr().out
