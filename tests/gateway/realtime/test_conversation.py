"""Conversation items and prompt rendering (no engine): item order, append-only rendering."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.realtime import protocol as p
from gateway.realtime.conversation import Conversation, Item, PromptRenderer, parse_item, to_messages


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


def test_renderer_tokenizes_as_the_tokenizer_does_from_many_threads(renderer):
    """The renderer calls the fast tokenizer's backend without a lock: the ids and texts are the tokenizer's own, and
    many threads tokenizing at once (as sessions and HTTP requests do) each get exactly what one thread alone gets."""
    tok = renderer.tokenizer
    texts = ["", "Hello, world!", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "naïve café 東京 🙂",
             " leading and trailing  ", "x" * 5000] + [f"turn {i}: " + "word " * (i * 50) for i in range(40)]
    for text in texts:
        ids = renderer.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert renderer.decode(ids) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    alone = [renderer.encode(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(renderer.encode, texts * 4))
    assert together == alone * 4
    assert renderer.max_token_chars() == max(len(t) for t in tok.get_vocab())
