"""Memory caps of one Realtime session: the size of one conversation item and of the whole conversation.

Every byte a client stores in a conversation stays in the server's memory for the life of the session (and is echoed
back by `conversation.item.retrieve`), so what a client may store is bounded: one item, and the conversation as a
whole in items and bytes. Sizes count the characters of the item's strings (text, base64 audio, transcripts, function
arguments and outputs), which is what the server holds. A refused item is answered with an `error` event whose `param`
names it; nothing is stored and the session goes on.
"""
from __future__ import annotations

from gateway.realtime import protocol as p
from gateway.realtime.conversation import Conversation, Item

# One item: two minutes of 24 kHz pcm16 audio in base64 fit, which is longer than any one turn.
MAX_ITEM_BYTES = 8 * 1024 * 1024
# A conversation: four maximal items. Past the model's context the oldest items are truncated from the prompt anyway;
# the rest is only kept to be retrieved.
MAX_CONVERSATION_BYTES = 32 * 1024 * 1024
MAX_CONVERSATION_ITEMS = 1024


def item_bytes(item: Item) -> int:
    """What the server holds for `item`: the characters of its strings."""
    size = sum(len(value) for part in item.content for value in part.values() if isinstance(value, str))
    return size + sum(len(value) for value in (item.name, item.arguments, item.output, item.call_id)
                      if value is not None)


def check_item(item: Item, param: str, max_item_bytes: int = MAX_ITEM_BYTES) -> int:
    """Refuse an item over the one-item cap; returns its size."""
    size = item_bytes(item)
    if size > max_item_bytes:
        raise p.ProtocolError(f"Item is too large ({size} bytes; the limit is {max_item_bytes}).", "item_too_large",
                              param)
    return size


def check_room(conversation: Conversation, size: int, param: str, max_items: int = MAX_CONVERSATION_ITEMS,
               max_bytes: int = MAX_CONVERSATION_BYTES) -> None:
    """Refuse adding an item of `size` bytes to a conversation that has no room left for it."""
    if len(conversation.items) >= max_items:
        raise p.ProtocolError(f"The conversation is full ({len(conversation.items)} items; the limit is {max_items}). "
                              "Delete items to make room.", "conversation_too_large", param)
    held = sum(item_bytes(it) for it in conversation.items)
    if held + size > max_bytes:
        raise p.ProtocolError(f"The conversation is full ({held} bytes held, this item is {size}; the limit is "
                              f"{max_bytes}). Delete items to make room.", "conversation_too_large", param)
