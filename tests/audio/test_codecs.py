"""Codecs, format mapping, resampling, the input audio buffer and the sentence chunker."""

import base64

import numpy as np
import pytest

from audio.buffer import MAX_APPEND_B64_CHARS, AudioBufferError, InputAudioBuffer
from audio.chunker import SentenceChunker
from audio.codecs import (
    AudioFormat, AudioFormatError, alaw_decode, alaw_encode, b64encode, decode_b64_audio, encode_b64_audio,
    parse_audio_format, pcm16_decode, pcm16_encode, ulaw_decode, ulaw_encode,
)
from audio.resample import StreamResampler, resample
from audio.speech import espeak_speech


def _sine(freq, rate, seconds=1.0, amp=0.5):
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x, rate):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.fft.rfftfreq(len(x), 1 / rate)[spec.argmax()]


# ---------------------------------------------------------------- pcm16 / base64

def test_pcm16_round_trip_and_little_endian():
    x = np.array([0, 1, -1, 32767, -32768, 1234], np.int16)
    raw = pcm16_encode(x)
    assert raw[:4] == b"\x00\x00\x01\x00"  # little endian
    assert np.array_equal(pcm16_decode(raw), x)
    fmt = parse_audio_format(None)
    assert np.array_equal(decode_b64_audio(encode_b64_audio(x, fmt), fmt), x)


@pytest.mark.parametrize("bad", ["not base64!!", "AAA", "AA=A", 12])
def test_bad_base64_is_a_typed_error(bad):
    with pytest.raises(AudioFormatError, match="base64"):
        decode_b64_audio(bad, AudioFormat())


def test_odd_byte_count_is_a_typed_error():
    with pytest.raises(AudioFormatError, match="even number of bytes"):
        decode_b64_audio(base64.b64encode(b"\x01\x02\x03").decode(), AudioFormat())


# ---------------------------------------------------------------- G.711

def test_g711_reference_points():
    # ITU-T G.711 code words: silence, full scale, and the decoder's reconstruction levels.
    assert ulaw_encode(np.array([0, 32767, -32768], np.int16)).tolist() == [0xFF, 0x80, 0x00]
    assert alaw_encode(np.array([0, 32767, -32768], np.int16)).tolist() == [0xD5, 0xAA, 0x2A]
    assert ulaw_decode(bytes([0xFF, 0x80, 0x00, 0x7F])).tolist() == [0, 32124, -32124, 0]
    assert alaw_decode(bytes([0xD5, 0xAA, 0x2A, 0x55])).tolist() == [8, 32256, -32256, -8]


@pytest.mark.parametrize("enc,dec", [(ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)])
def test_g711_round_trips(enc, dec):
    codes = np.arange(256, dtype=np.uint8)
    levels = dec(codes)
    # Every reconstruction level encodes back to a code of the same level (0x7F/0xFF both mean 0 in µ-law).
    assert np.array_equal(dec(enc(levels)), levels)
    # Companding error is relative: under 1/16 of the magnitude beyond the smallest segment.
    x = np.linspace(-32768, 32767, 20001).astype(np.int16)
    y = dec(enc(x)).astype(np.int32)
    err = np.abs(y - x)
    assert np.all(err <= np.maximum(np.abs(x.astype(np.int32)) / 16, 128))
    # Monotonic: a louder input never decodes quieter.
    assert np.all(np.diff(dec(enc(np.arange(-32768, 32768, 7).astype(np.int16))).astype(np.int32)) >= 0)


def test_g711_on_speech_keeps_it_intelligible():
    x = (espeak_speech("hello there", rate=8000) * 32767).astype(np.int16)
    for fmt in ("g711_ulaw", "g711_alaw"):
        f = parse_audio_format(fmt)
        y = decode_b64_audio(encode_b64_audio(x, f), f)
        snr = 10 * np.log10((x.astype(float) ** 2).sum() / ((x.astype(float) - y) ** 2).sum())
        assert len(y) == len(x) and snr > 25, (fmt, snr)


# ---------------------------------------------------------------- formats

def test_format_mapping_ga_and_beta():
    assert parse_audio_format({"type": "audio/pcm", "rate": 24000}) == AudioFormat("pcm16", 24000)
    assert parse_audio_format({"type": "audio/pcmu"}) == AudioFormat("pcmu", 8000)
    assert parse_audio_format({"type": "audio/pcma"}) == AudioFormat("pcma", 8000)
    assert parse_audio_format("pcm16") == AudioFormat("pcm16", 24000)
    assert parse_audio_format("g711_ulaw") == AudioFormat("pcmu", 8000)
    assert parse_audio_format("g711_alaw").to_ga() == {"type": "audio/pcma"}
    assert parse_audio_format({"type": "audio/pcm"}).to_beta() == "pcm16"


@pytest.mark.parametrize("bad", ["mp3", {"type": "audio/ogg"}, {"type": "audio/pcm", "rate": 16000}, 5, {}])
def test_bad_formats_are_typed_errors(bad):
    with pytest.raises(AudioFormatError):
        parse_audio_format(bad)


# ---------------------------------------------------------------- resampling

@pytest.mark.parametrize("src,dst", [(24000, 16000), (22050, 24000), (8000, 16000), (16000, 8000), (22050, 8000)])
def test_resample_keeps_length_and_frequency(src, dst):
    x = _sine(440, src)
    y = resample(x, src, dst)
    assert y.dtype == np.float32 and abs(len(y) - dst) <= 1
    assert abs(_peak_hz(y, dst) - 440) < 2
    yi = resample((x * 32767).astype(np.int16), src, dst)
    assert yi.dtype == np.int16 and abs(len(yi) - dst) <= 1
    assert abs(_peak_hz(yi.astype(np.float32), dst) - 440) < 2


def test_stream_resampler_matches_one_shot():
    x = _sine(1000, 24000, 2.0)
    s = StreamResampler(24000, 16000)
    rng = np.random.default_rng(0)
    outs, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 2000))
        outs.append(s.process(x[i : i + n]))
        i += n
    outs.append(s.flush())
    y = np.concatenate(outs)
    ref = resample(x, 24000, 16000)
    assert len(y) == len(ref)
    assert np.abs(y - ref).max() < 1e-3
    assert abs(_peak_hz(y, 16000) - 1000) < 2


@pytest.mark.parametrize("src,dst", [(24000, 16000), (8000, 16000), (48000, 16000), (22050, 24000)])
def test_stream_resampler_holds_back_only_its_lookahead(src, dst):
    """The VAD hears the silence after the last word only once it is resampled: after every 40 ms append, all but the
    filter's lookahead (a few ms) has come out (soxr's stream held back whole blocks)."""
    s = StreamResampler(src, dst)
    assert 0 < s.lookahead_ms <= 6
    x, step, out = _sine(300, src, 1.0), src // 25, 0
    for i in range(0, len(x), step):
        out += len(s.process(x[i : i + step]))
        behind_ms = 1000 * min(i + step, len(x)) / src - 1000 * out / dst
        assert behind_ms <= s.lookahead_ms + 1000 / dst
    tail = s.flush()
    assert out + len(tail) == len(x) * dst // src


def test_stream_resampler_int16_and_restart():
    """int16 in, int16 out (the TTS path), with the one-shot's values; after flush() the next stream starts fresh."""
    x = (_sine(440, 22050, 0.5) * 20000).astype(np.int16)
    s = StreamResampler(22050, 24000, dtype="int16")
    for _ in range(2):
        y = np.concatenate([s.process(x[:3000]), s.process(x[3000:]), s.flush()])
        ref = resample(x, 22050, 24000)
        assert y.dtype == np.int16 and len(y) == len(ref)
        assert np.abs(y[100:-100].astype(np.int32) - ref[100:-100]).max() <= 2


# ---------------------------------------------------------------- input audio buffer

def _b64_pcm(ms, rate=24000, freq=300):
    return b64encode(pcm16_encode((_sine(freq, rate, ms / 1000) * 32767).astype(np.int16)))


def test_buffer_append_commit_and_timeline():
    buf = InputAudioBuffer()
    out = buf.append_b64(_b64_pcm(250))
    assert out.dtype == np.float32
    buf.append_b64(_b64_pcm(250))
    assert buf.duration_ms == 500 and buf.timeline_ms == 500
    c = buf.commit()
    assert (c.audio_start_ms, c.audio_end_ms) == (0, 500) and len(c.audio_16k) == 8000
    assert buf.duration_ms == 0
    buf.append_b64(_b64_pcm(200))
    c = buf.commit()
    assert (c.audio_start_ms, c.audio_end_ms) == (500, 700)


def test_buffer_commit_rules():
    buf = InputAudioBuffer()
    with pytest.raises(AudioBufferError) as e:
        buf.commit()
    assert e.value.code == "input_audio_buffer_commit_empty"
    buf.append_b64(_b64_pcm(60))
    with pytest.raises(AudioBufferError) as e:
        buf.commit()
    assert e.value.code == "input_audio_buffer_commit_empty" and "100ms" in e.value.message
    buf.clear()
    assert buf.duration_ms == 0 and buf.timeline_ms == 60


def test_buffer_limits_and_bad_input():
    buf = InputAudioBuffer(max_ms=1000)
    with pytest.raises(AudioBufferError, match="15 MiB"):
        buf.append_b64("A" * (MAX_APPEND_B64_CHARS + 4))
    with pytest.raises(AudioFormatError):
        buf.append_b64("%%%")
    buf.append_b64(_b64_pcm(900))
    with pytest.raises(AudioBufferError) as e:
        buf.append_b64(_b64_pcm(200))
    assert e.value.code == "input_audio_buffer_full"
    assert buf.duration_ms == 900  # nothing grew
    buf.commit()
    buf.append_b64(_b64_pcm(200))  # room again after the commit


def test_buffer_g711_and_vad_range():
    buf = InputAudioBuffer(parse_audio_format("g711_ulaw"))
    x = (_sine(300, 8000, 2.0) * 20000).astype(np.int16)
    buf.append_b64(b64encode(ulaw_encode(x).tobytes()))
    assert buf.duration_ms == 2000
    seg = buf.commit_range(500, 1500)
    assert (seg.audio_start_ms, seg.audio_end_ms) == (500, 1500) and len(seg.audio_16k) == 16000
    assert abs(_peak_hz(seg.audio_16k, 16000) - 300) < 3
    assert buf.start_ms == 1500


# ---------------------------------------------------------------- chunker

def _chunk(text, step):
    c, out = SentenceChunker(), []
    for i in range(0, len(text), step):
        out += c.push(text[i : i + step])
    return out + c.flush()


@pytest.mark.parametrize("step", [1, 3, 50])
def test_chunker_cuts_first_clause_then_sentences(step):
    text = ("Well, the capital of France is Paris, a city of about 2.1 million people. "
            "Dr. Smith said so, e.g. in his book. It is lovely! Visit it")
    assert _chunk(text, step) == [
        "Well, the capital of France is Paris,",
        "a city of about 2.1 million people.",
        "Dr. Smith said so, e.g. in his book.",
        "It is lovely!",
        "Visit it",
    ]


@pytest.mark.parametrize("step", [1, 4])
def test_chunker_first_piece_at_a_word_boundary_when_no_punctuation_comes(step):
    def chunk(text):
        c, out = SentenceChunker(first_min_words=2, first_max_words=4), []
        for i in range(0, len(text), step):
            out += c.push(text[i : i + step])
        return out + c.flush()

    assert chunk("The capital of France is Paris. It is lovely.") == ["The capital of France", "is Paris.", "It is lovely."]
    # never ends on a word that leans on the next one; punctuation inside the limit still wins; later pieces are sentences
    assert chunk("I think that the answer is 42. Yes it is") == ["I think that the answer", "is 42.", "Yes it is"]
    assert chunk("Paris, the City of Light, is the capital.") == ["Paris, the City of Light,", "is the capital."]
    assert chunk("Hi! How are you today my friend?") == ["Hi!", "How are you today my friend?"]
    assert chunk("Yes") == ["Yes"]
    whole = SentenceChunker(first_min_words=2, first_max_words=4)   # a sentence that has already arrived stays whole
    assert whole.push("The capital of France is Paris. It") == ["The capital of France is Paris."]


def test_chunker_short_and_empty():
    assert _chunk("Hi! How are you?", 2) == ["Hi!", "How are you?"]
    assert _chunk("", 1) == []
    assert _chunk("   ", 1) == []
    long = "word " * 200
    pieces = _chunk(long, 7)
    assert all(len(p) <= 300 for p in pieces) and " ".join(pieces).split() == long.split()


def test_chunker_cuts_early_on_demand():
    """`cut_now` (the listener is about to run dry): up to the last clause boundary, else after the last complete word
    that does not lean on the next; never half a word, nothing with too few words; the rest goes on as usual."""
    c = SentenceChunker(first_min_words=2, first_max_words=4)
    assert c.push("The capital of France is") == ["The capital of France"]
    assert c.push(" Paris, a city of light, and a city of") == [] and c.cut_now() == ["is Paris, a city of light,"]
    assert c.push(" art and the mus") == [] and c.cut_now() == ["and a city of art"]  # not "mus", not after "the"
    assert c.cut_now() == []  # "and the": too few words, and both lean
    assert c.push("eums. Then") == ["and the museums."] and c.flush() == ["Then"]
    d = SentenceChunker()
    assert d.push("One two") == [] and d.cut_now() == [] and d.cut_now(min_words=1) == ["One"]
