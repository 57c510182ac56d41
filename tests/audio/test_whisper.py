"""Whisper tiny.en from the packaged CTranslate2 model, and the shared batched Transcriber."""

import asyncio
import re

import jiwer
import numpy as np
import pytest
import torch

from audio.speech import espeak_speech
from audio.transcriber import Transcriber, TranscriptionError
from audio.whisper import NO_SPEECH_THRESHOLD, WhisperModel, ct2_to_hf_state_dict, package_model_dir, read_ct2_model
from tests.audio.speech import steady_piper_speech

torch.set_num_threads(2)

REF = "what is the capital of france"


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9' ]", " ", s.lower())).strip()


def as_turn(speech: np.ndarray) -> np.ndarray:
    """What server VAD hands the transcriber: 300 ms of prefix padding, the speech, 500 ms of silence."""
    return np.concatenate([np.zeros(4800, np.float32), speech, np.zeros(8000, np.float32)])


@pytest.fixture(scope="module")
def clips():
    return {"espeak": as_turn(espeak_speech("What is the capital of France?")),
            "piper": as_turn(steady_piper_speech("What is the capital of France?"))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # A fresh cache: this exercises the one-time conversion from model.bin.
    cache = tmp_path_factory.mktemp("rtserve-cache")
    WhisperModel.load(cache=cache, dtype=torch.bfloat16, quiet=True)
    weights = cache / "whisper-tiny.en" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    m = WhisperModel.load(cache=cache, dtype=torch.bfloat16)
    m.reconverted = weights.stat().st_mtime_ns != stamp
    return m


@pytest.fixture(scope="module")
def transcriber(model):
    t = Transcriber(model)
    yield t
    t.close()


def test_ct2_reader_maps_every_weight():
    v = read_ct2_model(package_model_dir() / "model.bin")
    assert v["decoder/embeddings/weight"].dtype == np.float16  # the package ships float16
    sd, dims = ct2_to_hf_state_dict(v)
    assert dims["d_model"] == 384 and dims["encoder_layers"] == 4 and dims["vocab_size"] == 51864
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert "model.encoder.layers.0.self_attn.k_proj.bias" not in sd
    # The fused q/k/v rows land in the right projections (CTranslate2 stores zeros as the k bias).
    fused = v["encoder/layer_0/self_attention/linear_0/bias"]
    assert not fused[384:768].any()
    assert np.array_equal(sd["model.encoder.layers.0.self_attn.v_proj.bias"].numpy(), fused[768:].astype(np.float32))


def test_cached_load_is_complete(model):
    assert not model.reconverted  # the second load came from the safetensors cache
    assert not any(p.is_meta for p in model.model.parameters())
    assert model.model.proj_out.weight is model.model.model.decoder.embed_tokens.weight


@pytest.mark.parametrize("voice", ["espeak", "piper"])
def test_transcribes_real_speech(model, clips, voice):
    text = model.transcribe([clips[voice]])[0]
    assert jiwer.wer(REF, _norm(text)) <= 0.2, text


@pytest.mark.slow
def test_fp32_and_batch_agree(clips):
    exact = WhisperModel.load(dtype=torch.float32)
    texts = exact.transcribe([clips["espeak"], clips["piper"]])
    assert all(jiwer.wer(REF, _norm(t)) <= 0.2 for t in texts), texts


async def test_transcriber_streams_deltas(transcriber, clips):
    stream = transcriber.transcribe(clips["piper"])
    deltas = [d async for d in stream]
    assert len(deltas) >= 3  # token by token, not one blob
    assert "".join(deltas) == stream.text
    assert jiwer.wer(REF, _norm(stream.text)) <= 0.2
    assert 0.0 < stream.heard <= 1.0  # how sure Whisper was of the ending (WhisperModel.heard_ending)
    [p_none] = stream.no_speech_probs  # Whisper's no_speech_prob of its one window: this is speech
    assert 0.0 < p_none < 0.1, p_none


async def test_transcriber_batches_concurrent_requests(transcriber, clips):
    """Four sessions submitting in the same event-loop tick: each is encoded exactly once, in batches whose sizes add
    up to four (however the worker's wake-up falls between the submissions), and transcribed right."""
    before = dict(transcriber.stats.batch_sizes)
    audios = [clips["espeak"], clips["piper"], clips["piper"], clips["espeak"]]
    streams = [transcriber.transcribe(a) for a in audios]
    texts = await asyncio.gather(*(s.result() for s in streams))
    assert all(jiwer.wer(REF, _norm(t)) <= 0.2 for t in texts), texts
    after = transcriber.stats.batch_sizes
    grew = {size: after[size] - before.get(size, 0) for size in after if after[size] != before.get(size, 0)}
    assert sum(size * n for size, n in grew.items()) == 4 and all(n > 0 for n in grew.values()), grew
    snap = transcriber.stats.snapshot()
    assert snap["audio_seconds"] > 0 and snap["encoder_seconds"] > 0 and snap["rtf"] > 0


@pytest.mark.slow
async def test_long_audio_is_windowed(transcriber, clips):
    other = steady_piper_speech("Tell me a short story about a cat.")
    long = np.concatenate([clips["piper"], np.zeros(16000 * 29, np.float32), other])
    text = await transcriber.transcribe_text(long)
    assert jiwer.wer(REF + " tell me a short story about a cat", _norm(text)) <= 0.2, text


@pytest.mark.slow
async def test_cancelled_consumer_is_dropped(transcriber):
    story = steady_piper_speech("Once upon a time there was a small cat who lived in a quiet village by the sea. "
                         "Every morning the cat walked to the harbour to watch the boats come in.")
    cancelled = transcriber.stats.cancelled

    async def consume():
        async for _ in transcriber.transcribe(story):
            got_first.set()

    got_first = asyncio.Event()
    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(600):
        if transcriber.inflight == 0:
            break
        await asyncio.sleep(0.05)
    assert transcriber.inflight == 0
    assert transcriber.stats.cancelled == cancelled + 1
    # The worker goes on serving.
    assert "story" in _norm(await transcriber.transcribe_text(espeak_speech("tell me a story")))


async def test_bad_input_is_typed(transcriber):
    with pytest.raises(TranscriptionError):
        transcriber.transcribe(np.zeros((2, 16000), np.float32))
    with pytest.raises(TranscriptionError):
        transcriber.transcribe(np.zeros(10, np.float32))
    with pytest.raises(TranscriptionError):
        transcriber.transcribe(np.full(16000, np.nan, np.float32))
    with pytest.raises(TranscriptionError):
        transcriber.transcribe(np.array(["a", "b"]))


async def test_silence_and_noise_give_empty_transcripts(transcriber):
    rng = np.random.default_rng(0)
    for audio in (np.zeros(16000, np.float32), rng.normal(0, 0.1, 32000).astype(np.float32)):
        stream = transcriber.transcribe(audio)
        assert [d async for d in stream] == [] and stream.text == ""
        # ended at SOT: Whisper's no_speech_prob is over the threshold
        assert len(stream.no_speech_probs) == 1 and NO_SPEECH_THRESHOLD < stream.no_speech_probs[0] <= 1.0


async def test_closed_transcriber_refuses_work(model):
    t = Transcriber(model)
    t.close()
    with pytest.raises(TranscriptionError, match="closed"):
        t.transcribe(np.zeros(16000, np.float32))


def test_batch_rows_finish_independently(model, clips):
    """A short row ends early and leaves the batch; the long row goes on to its end."""
    long_ref = "the quick brown fox jumps over the lazy dog and then it runs into the forest"
    long = steady_piper_speech("The quick brown fox jumps over the lazy dog, and then it runs into the forest.")
    texts = model.transcribe([clips["piper"], long, np.zeros(16000, np.float32)])
    assert jiwer.wer(REF, _norm(texts[0])) <= 0.2, texts
    assert jiwer.wer(long_ref, _norm(texts[1])) <= 0.2, texts
    assert texts[2] == ""


QUESTIONS = ["what is the capital of france", "tell me a joke about cats", "how far away is the moon from the earth",
             "please set a timer for ten minutes", "who wrote the novel pride and prejudice",
             "why is the sky blue", "how many legs does a spider have", "play some relaxing music"]


def test_encoder_context_follows_the_audio(model):
    """Short turns are encoded over their own length + padding (≥ 8 s, whole seconds), not the 30 s window."""
    assert model.context_positions(16000 * 2) == 400            # 2 s -> the 8 s floor
    assert model.context_positions(16000 * 8) == 450            # 8 s + 1 s padding
    assert model.context_positions(16000 * 12 + 1) == 700       # 12 s + 1 s padding, rounded up to 14 s
    assert model.context_positions(16000 * 40) == 1500          # never past Whisper's window
    feats = model.features([np.zeros(16000 * 3, np.float32), np.zeros(16000 * 11, np.float32)])
    assert feats.shape == (2, 80, 1200)                         # the longest clip decides: 11 s + 1 s
    assert model.encode(feats).shape == (2, 600, 384)
    assert model.max_tokens_for(16000 * 3) == 46
    # only the audio + 1 s is computed; the floor's further positions come from the silence tail
    assert model.exact_positions(16000 * 2) == 150 and model.exact_positions(16000 * 8) == 450
    assert model.encode_clips([np.zeros(16000 * 2, np.float32)]).shape == (1, 400, 384)
    assert model.encode_clips([np.zeros(16000 * 3, np.float32), np.zeros(16000 * 11, np.float32)]).shape == \
        (2, 600, 384)


def test_silence_tail_stands_in_for_the_padding(model, clips):
    """A short turn is encoded over its audio + 1 s only, attending to a silence run's keys and values past it
    (`encode_clips`): its states agree with the whole context's pass, the transcripts are the same, and a clip that
    fills the floor is encoded exactly as before."""
    for clip in clips.values():
        exact = model.exact_positions(len(clip))
        assert exact < model.context_positions(len(clip))
        tail, whole = model.encode_clips([clip]).float(), model.encode(model.features([clip])).float()
        cos = torch.nn.functional.cosine_similarity(tail[0, :exact], whole[0, :exact], dim=-1)
        assert cos.mean() > 0.98, cos
        texts = [model.detokenize(t).strip() for t in model.decode_greedy(torch.stack([tail[0], whole[0]]).to(
            model.dtype), [model.max_tokens_for(len(clip))] * 2)]
        assert texts[0] == texts[1] and jiwer.wer(REF, _norm(texts[0])) <= 0.2, texts
    long = np.concatenate([clips["piper"], np.zeros(16000 * 8, np.float32)])
    assert model.exact_positions(len(long)) >= model.context_positions(len(long))
    assert torch.equal(model.encode_clips([long]), model.encode(model.features([long])))
    # one tail per padding value (rounded), reused
    kept = len(model._tails)
    model.encode_clips([clips["piper"]])
    assert len(model._tails) == kept


@pytest.mark.slow
def test_short_context_is_as_accurate_as_the_full_window(model):
    """Eight questions (piper and espeak): the short encoder context transcribes them as well as the full 30 s
    window, and never falls into a repetition loop."""
    audios = [(steady_piper_speech if i % 2 == 0 else espeak_speech)(q) for i, q in enumerate(QUESTIONS)]
    audios = [as_turn(a) for a in audios]
    short = model.transcribe(audios)
    full_feats = model.features(audios, positions=1500)
    full = [model.detokenize(t).strip() for t in model.decode_greedy(model.encode(full_feats))]
    wer_short = np.mean([jiwer.wer(q, _norm(t) or "x") for q, t in zip(QUESTIONS, short)])
    wer_full = np.mean([jiwer.wer(q, _norm(t) or "x") for q, t in zip(QUESTIONS, full)])
    assert wer_short <= max(0.15, wer_full + 0.05), (short, full)
    assert all(len(t.split()) <= 2 * len(q.split()) for q, t in zip(QUESTIONS, short)), short


def test_token_cap_stops_a_looping_decoder(model, clips):
    """With almost no padding tiny.en loops on a question; the per-row cap ends the row at its limit."""
    enc = model.encode(model.features([clips["piper"]], positions=int(len(clips["piper"]) / 320) + 1))
    tokens = model.decode_greedy(enc, [12])[0]
    assert 0 < len(tokens) <= 12


def test_a_looping_decoder_keeps_one_copy_and_stops(model, clips):
    """With almost no padding tiny.en loops on a question ("What is the capital of France? What is the capital of
    France? ..."); under a generous cap the loop guard ends the row with the question said once."""
    for clip in clips.values():
        enc = model.encode(model.features([clip], positions=int(len(clip) / 320) + 1))
        tokens = model.decode_greedy(enc, [120])[0]
        text = _norm(model.detokenize(tokens))
        assert len(tokens) < 20 and text.count("what is the") == 1, text


def test_the_loop_guard_wants_a_block_three_times_over():
    from audio.whisper import LOOP_MIN_TOKENS, looped

    block = list(range(10, 10 + LOOP_MIN_TOKENS + 2))
    assert looped([1, 2] + block * 3) == len(block)
    assert looped([1, 2] + block * 2) == 0  # twice may be said
    assert looped(block * 3 + [7]) == 0  # only where the tokens end
    assert looped([5] * 9) == 0  # "no, no, no": a short block is speech, not a loop
    assert looped([]) == 0


def test_quantized_linears_agree_with_the_dense_model(model, clips):
    """Every linear layer and the vocabulary projection on 8-bit blocks for the packed kernel (this CPU has one): the
    encoder's states and the logits within the blocks' rounding of the dense bf16 model's, and the same tokens."""
    assert model._proj_blocks is not None
    plain = WhisperModel.load(dtype=torch.bfloat16, pack=False)
    feats = model.features([clips["piper"], clips["espeak"]])
    enc, enc_plain = model.encode(feats).float(), plain.encode(feats.to(plain.encoder_dtype)).float()
    assert (enc - enc_plain).norm() < 0.05 * enc_plain.norm()
    assert model.decode_greedy(enc.to(model.dtype)) == plain.decode_greedy(enc.to(model.dtype))
    # Gaussian hidden states (seeded: the rounding error depends on the draw, 0.6-3.7 % over 200 draws, median 1.4 %)
    hidden = torch.randn(3, 384, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours, ref = model._logits(hidden), plain._logits(hidden)
    assert ours.shape == ref.shape == (3, 51864)
    assert (ours - ref).norm() < 0.04 * ref.norm()


def test_traced_passes_agree_with_the_python_modules(model, clips, monkeypatch):
    """The encoder and the decoder step run as TorchScript traces (which hold no GIL while they run), traced at one
    shape and used at others: a batch of two encoder lengths, and a row joining a decoder two steps in (other positions,
    a padded and masked cross-attention), give the states, logits and tokens of the same passes run as Python modules
    (`RTSERVE_WHISPER_GRAPH=0`)."""
    assert isinstance(model.encoder_pass, torch.jit.ScriptModule)
    assert isinstance(model.decoder_pass, torch.jit.ScriptModule)
    monkeypatch.setenv("RTSERVE_WHISPER_GRAPH", "0")
    plain = WhisperModel.load(dtype=torch.bfloat16)
    assert not isinstance(plain.encoder_pass, torch.jit.ScriptModule)
    long = np.concatenate([clips["espeak"], np.zeros(16000 * 11, np.float32)])
    assert isinstance(model.tail_encoder_pass, torch.jit.ScriptModule)
    for audios in ([clips["piper"]], [clips["piper"], long], [clips["piper"], clips["espeak"]]):
        feats = model.features(audios)
        torch.testing.assert_close(model.encode(feats).float(), plain.encode(feats).float(), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(model.encode_clips(audios).float(), plain.encode_clips(audios).float(),
                                   atol=1e-3, rtol=1e-3)
    enc_a, enc_b = (model.encode(model.features([a])) for a in (clips["piper"], long))
    assert enc_b.shape[1] > enc_a.shape[1]
    tokens = []
    for m in (model, plain):
        dec, logits, done = m.decoder(), [], {}
        dec.add(enc_a, ["a"], [40])
        while dec.rows:
            if len(logits) == 2:
                dec.add(enc_b, ["b"], [40])
            for key, toks, end in dec.step():
                if end:
                    done[key] = list(toks)
            logits.append(dec.last_logits.clone())
        tokens.append(done)
        if m is plain:
            for ours, ref in zip(first, logits):
                torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
        first = logits
    assert tokens[0] == tokens[1] and tokens[0]["a"] and tokens[0]["b"]


def test_decoder_loop_matches_transformers(clips):
    """Our cached decoder loop picks, at every step, the token HF's own uncached forward ranks first (fp32)."""
    from audio.whisper import NO_TIMESTAMPS, SOT
    exact = WhisperModel.load(dtype=torch.float32)
    enc = exact.encode(exact.features([clips["piper"], clips["espeak"]]))
    for row, toks in enumerate(exact.decode_greedy(enc)):
        assert toks
        with torch.inference_mode():
            ids = torch.tensor([[SOT, NO_TIMESTAMPS] + toks])
            ref = exact.model(encoder_outputs=(enc[row:row + 1],), decoder_input_ids=ids).logits[0].float()
        for j, tok in enumerate(toks):
            mask = exact._suppress_begin if j == 0 else exact._suppress
            assert ref[1 + j].masked_fill(mask, float("-inf")).argmax().item() == tok


def test_rows_joining_a_running_decoder_decode_as_alone(clips):
    """Continuous batching: a row that joins after three steps, with a longer encoder context (so its companions'
    keys are zero-padded and masked), and a silent row that ends at SOT, give the logits (fp32, to 1e-4) and tokens
    each gives alone."""
    exact = WhisperModel.load(dtype=torch.float32)
    long = np.concatenate([clips["espeak"], np.zeros(16000 * 11, np.float32)])   # ~14 s: a 15 s context
    audios = {"a": clips["piper"], "b": long, "c": np.zeros(16000, np.float32)}
    enc = {k: exact.encode(exact.features([a])) for k, a in audios.items()}
    caps = {k: exact.max_tokens_for(len(a)) for k, a in audios.items()}
    p_b, p_c = enc["b"].shape[1], enc["c"].shape[1]
    assert enc["a"].shape[1] < p_b and p_c < p_b
    alone = {}
    for k in audios:  # each row by itself: the logits of every step, and its tokens
        dec = exact.decoder()
        dec.add(enc[k], [k], [caps[k]])
        logits = []
        while dec.rows:
            out = dec.step()
            logits.append(dec.last_logits[0].clone())
        alone[k] = (logits, out[0][1])
    assert alone["a"][1] and alone["b"][1] and alone["c"][1] == []
    dec = exact.decoder()
    dec.add(enc["a"], ["a"], [caps["a"]])
    got, rows_seen, steps = {}, [], {k: 0 for k in audios}
    while dec.rows or not rows_seen:
        if len(rows_seen) == 3:
            dec.add(torch.cat([enc["b"], torch.nn.functional.pad(enc["c"], (0, 0, 0, p_b - p_c))]), ["b", "c"],
                    [caps["b"], caps["c"]], lengths=[p_b, p_c])
        keys = [r.key for r in dec.rows]
        rows_seen.append(len(keys))
        for key, toks, done in dec.step():
            if done:
                got[key] = list(toks)
        for i, k in enumerate(keys):
            torch.testing.assert_close(dec.last_logits[i], alone[k][0][steps[k]], atol=1e-4, rtol=1e-4)
            steps[k] += 1
    assert got == {k: v[1] for k, v in alone.items()} and max(rows_seen) == 3 and dec.cross_k is None


async def test_a_late_request_joins_the_running_decoder(transcriber, clips):
    """A transcription submitted while another decodes is encoded between two steps and decodes in the same steps."""
    steps, rows = transcriber.stats.decode_steps, transcriber.stats.decode_rows
    story = steady_piper_speech("Once upon a time there was a small cat who lived in a quiet village by the sea.")
    first = transcriber.transcribe(story)
    await first.__anext__()  # the first row is decoding
    second = transcriber.transcribe(clips["piper"])
    texts = await asyncio.gather(first.result(), second.result())
    assert jiwer.wer(REF, _norm(texts[1])) <= 0.2 and "village" in _norm(texts[0]), texts
    assert transcriber.stats.max_decode_rows >= 2
    assert transcriber.stats.decode_rows - rows > transcriber.stats.decode_steps - steps  # some steps had two rows


def test_a_row_joins_after_a_longer_capped_row_left(model, clips):
    """The self-attention cache keeps the length of the longest row that has been in it: a silent 20 s window (token
    cap 216) ends at SOT, and a row that joins the remaining one later still fits and decodes its question."""
    dec = model.decoder()
    silent = np.zeros(16000 * 20, np.float32)
    enc = model.encode(model.features([silent, clips["piper"]]))
    dec.add(enc, ["silent", "first"], [model.max_tokens_for(len(silent)), model.max_tokens_for(len(clips["piper"]))])
    done = {k: t for k, t, d in dec.step() if d}
    assert done == {"silent": []} and [r.key for r in dec.rows] == ["first"]
    dec.add(model.encode(model.features([clips["espeak"]])), ["second"], [model.max_tokens_for(len(clips["espeak"]))])
    while dec.rows:
        done.update({k: list(t) for k, t, d in dec.step() if d})
    assert jiwer.wer(REF, _norm(model.detokenize(done["first"]))) <= 0.2, done
    assert jiwer.wer(REF, _norm(model.detokenize(done["second"]))) <= 0.2, done


@pytest.mark.slow
async def test_staggered_arrivals_and_cancellations_leave_nothing_behind(transcriber, clips):
    """Twelve requests arrive at staggered moments; every third consumer goes away mid-way (before or after its row
    joined). The others transcribe correctly, and the worker ends with nothing queued or decoding."""
    import random
    rng = random.Random(0)
    cancelled = transcriber.stats.cancelled

    async def one(i: int) -> str | None:
        await asyncio.sleep(rng.uniform(0, 0.3))
        stream = transcriber.transcribe(clips["piper" if i % 2 else "espeak"])
        if i % 3 == 0:
            await asyncio.sleep(rng.uniform(0, 0.05))
            await stream.aclose()
            return None
        return await stream.result()

    texts = await asyncio.gather(*(one(i) for i in range(12)))
    for i, text in enumerate(texts):
        if i % 3:
            assert jiwer.wer(REF, _norm(text)) <= 0.2, (i, text)
    for _ in range(200):
        if transcriber.inflight == 0:
            break
        await asyncio.sleep(0.05)
    assert transcriber.inflight == 0
    # each of the four left within 50 ms of submitting, before a ~60 ms transcription could end (one that had ended
    # would not count as a cancel)
    assert 1 <= transcriber.stats.cancelled - cancelled <= 4
    assert transcriber.stats.max_decode_rows >= 2


def test_heard_ending_sums_the_spellings_of_an_ending(model):
    """P(the last word's first token, in any case) × P(a sentence end right after it), from the steps' candidates."""
    from audio.whisper import EOT

    def ids(text: str) -> list[int]:
        return model.tokenizer.encode(text, add_special_tokens=False).ids

    (the,), (sun,), (Sun,), (moon,) = ids(" the"), ids(" sun"), ids(" Sun"), ids(" moon")
    (dot,), (q,), (comma,) = ids("."), ids("?"), ids(",")
    lg = np.log
    tops = [([the], [0.0]), ([sun, moon, Sun], [lg(0.5), lg(0.2), lg(0.3)]),
            ([dot, comma, q], [lg(0.6), lg(0.2), lg(0.2)]), ([EOT], [0.0])]
    assert model.heard_ending([the, sun, dot], tops) == pytest.approx(0.8 * 0.8)
    # no punctuation written: the end of the text after the word is the sentence end
    assert model.heard_ending([the, sun], [tops[0], tops[1], ([EOT, dot], [lg(0.7), lg(0.1)])]) == \
        pytest.approx(0.8 * 0.8)
    # a word's later pieces do not count; a "%" is part of the word, not its ending
    fifty, pct = ids(" 50")[0], ids("%")[0]
    assert model.heard_ending([fifty, pct, dot], [([fifty], [lg(0.9)]), ([pct], [lg(0.1)]), ([dot], [lg(0.5)]),
                                                  ([EOT], [0.0])]) == pytest.approx(0.45)
    assert model.heard_ending([the, sun, dot], tops[:3]) is None  # ended by its cap, not by EOT
    assert model.heard_ending([dot], [([dot], [0.0]), ([EOT], [0.0])]) is None  # no word


def test_a_guessed_ending_is_heard_with_less_certainty(model):
    """A complete question against the same kind of clause cut by silence ("The train leaves at um", which Whisper
    tends to finish with a word of its own): the transcript comes with how sure Whisper was of its ending."""
    said = as_turn(steady_piper_speech("Which planet is closest to the sun?"))
    cut = as_turn(steady_piper_speech("The train leaves at um"))
    (said_text, said_heard), (cut_text, cut_heard) = model.transcribe_heard([said, cut])
    assert [said_text, cut_text] == model.transcribe([said, cut])
    assert said_heard > 0.5 and said_heard > 1.5 * cut_heard, (said_text, said_heard, cut_text, cut_heard)


def test_a_draft_is_checked_in_one_pass_and_changes_no_transcript(model, clips):
    """A row's draft (an earlier transcription of the same speech) is checked in one pass: the decoder keeps the
    longest start of it that it would have chosen itself and goes on from there. Whole, cut, wrong, out-of-vocabulary
    or too long, the transcripts are those decoded without it; a whole one takes a single step."""
    from audio.whisper import EOT

    audios = [clips["piper"], clips["espeak"]]
    enc = [model.encode(model.features([a])) for a in audios]

    def decode(drafts, join_at=0):
        dec, done, steps = model.decoder(), {}, 0
        pending = [0, 1]
        while dec.rows or pending:
            if steps >= join_at and pending:
                for k in pending:
                    dec.add(enc[k], [k], [40], drafts=[drafts[k]])
                pending = []
            for key, toks, end in dec.step():
                if end:
                    done[key] = list(toks)
            steps += 1
        return done, steps, dec

    plain, plain_steps, _ = decode([None, None])
    assert all(plain.values())
    hello = model.tokenizer.encode(" Hello", add_special_tokens=False).ids[0]
    cases = {"whole": [plain[0], plain[1]], "cut": [plain[0][:3], plain[1][:2]],
             "wrong": [[hello] + plain[0][1:], plain[1][::-1]], "specials": [[EOT, 1], [99999, -1]],
             "too long": [plain[0] * 20, plain[1] * 20]}
    for name, drafts in cases.items():
        for join_at in (0, 2):
            done, steps, dec = decode(drafts, join_at)
            assert done == plain, (name, join_at)
            assert dec.draft_accepted <= dec.draft_tokens
    done, steps, dec = decode(cases["whole"])
    assert steps == 1 < plain_steps and dec.draft_accepted == len(plain[0]) + len(plain[1])


def test_a_draft_is_the_transcript_without_its_last_word(model):
    def ids(text: str) -> list[int]:
        return model.tokenizer.encode(text, add_special_tokens=False).ids

    assert model.detokenize(model.draft_of(ids(" What is the capital of?"))) == " What is the capital"
    assert model.detokenize(model.draft_of(ids(" who wrote Romido"))) == " who wrote"
    assert model.draft_of(ids(" Hello.")) == [] and model.draft_of([]) == []


async def test_a_transcription_drafts_the_next_one_of_the_same_speech(transcriber, clips):
    """A transcription returns a draft for the same speech continued, which a later one checks in one pass: the same
    transcript; and a request being encoded counts as in flight (what the engine and TTS yield to)."""
    first = transcriber.transcribe(clips["piper"])
    text = await first.result()
    assert first.draft and text.startswith(transcriber.model.detokenize(first.draft).strip()), (text, first.draft)
    before = transcriber.stats.draft_accepted
    again = transcriber.transcribe(clips["piper"], draft=first.draft)
    assert transcriber.inflight == 1
    assert await again.result() == text and transcriber.stats.draft_accepted == before + len(first.draft)
    # the draft's one pass reads SOT too: the same no-speech probability as the step that reads it alone
    assert again.no_speech_probs == pytest.approx(first.no_speech_probs, abs=1e-4)
    assert transcriber.inflight == 0

