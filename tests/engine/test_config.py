"""EngineArgs: page and block sizes are checked up front, with typed errors; the default page divides the block."""
import pytest

from engine import InvalidRequestError
from engine.config import EngineArgs


@pytest.mark.parametrize("args,param", [(dict(page_size=3), "page_size"), (dict(page_size=0), "page_size"),
                                        (dict(block_size=8, page_size=16), "page_size"),
                                        (dict(block_size=0), "block_size")])
def test_bad_page_and_block_sizes_raise_typed_errors(args, param):
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(**args)
    assert e.value.param == param


def test_default_page_size_divides_the_block_size():
    assert (EngineArgs().block_size, EngineArgs().page_size) == (16, 4)
    assert EngineArgs(block_size=6).page_size == 2 and EngineArgs(block_size=1).page_size == 1
