"""Model loading: a path that does not exist and a GGUF of an architecture rtserve does not implement fail with
ModelLoadError, naming the problem."""
import pytest

from engine import LLM, ModelLoadError


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent/model/dir")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="mamba"):
        LLM(model=str(path))
