"""The startup heap is frozen (engine/heap.py): what is alive then is left out of every later collection, and what is
created later is still collected."""
import gc
import weakref

from engine.heap import freeze_startup_heap


class Node:
    pass


def test_objects_alive_at_the_freeze_are_skipped_and_later_cycles_collected():
    startup = [[i] for i in range(50_000)]  # lists: tracked by the collector
    try:
        assert freeze_startup_heap("test") >= len(startup)  # (frozen objects that refcounting frees leave the count)
        tracked = {id(o) for o in gc.get_objects()}  # generations 0-2: what a collection walks
        assert not any(id(x) in tracked for x in startup)
        node = Node()
        node.self = node  # a cycle: only the collector frees it
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
