"""Streaming server VAD on real speech (piper and espeak-ng) with silence around it."""

import numpy as np
import pytest

from audio.buffer import InputAudioBuffer
from audio.codecs import b64encode, float_to_int16, pcm16_encode
from audio.resample import resample
from audio.speech import espeak_speech, speech_bounds_ms
from audio.vad import StreamingVAD, semantic_vad_silence_ms
from tests.audio.speech import steady_piper_speech

RATE = 16000
TOL_MS = 150


def _place(speech, lead_ms, tail_ms):
    """Silence + speech + silence; returns the clip and where the voice really is (ms)."""
    lo, hi = speech_bounds_ms(speech)
    clip = np.concatenate([np.zeros(lead_ms * 16, np.float32), speech, np.zeros(tail_ms * 16, np.float32)])
    return clip, lead_ms + lo, lead_ms + hi


def _feed(vad, x, chunk):
    events = []
    for i in range(0, len(x), chunk):
        events += vad.feed(x[i : i + chunk])
    return events


@pytest.fixture(scope="module")
def piper_clip():
    return steady_piper_speech("What is the capital of France?")


@pytest.mark.parametrize("chunk", [160, 480, 512, 4000])
def test_vad_offsets_on_piper_speech(piper_clip, chunk):
    clip, start, end = _place(piper_clip, 1200, 1500)
    vad = StreamingVAD(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
    ev = _feed(vad, clip, chunk)
    assert [e.type for e in ev] == ["speech_started", "speech_stopped"]
    # audio_start_ms includes the prefix padding, like OpenAI.
    assert abs(ev[0].audio_start_ms + 300 - start) <= TOL_MS, (ev, start)
    assert abs(ev[1].audio_end_ms - end) <= TOL_MS, (ev, end)
    assert ev[1].audio_start_ms == ev[0].audio_start_ms


def test_vad_two_utterances_espeak_and_segment_commit():
    a = espeak_speech("hello, how are you today")
    b = espeak_speech("tell me a short story about a cat")
    clip1, s1, e1 = _place(a, 800, 1000)
    clip2, s2, e2 = _place(b, 200, 1200)
    clip = np.concatenate([clip1, clip2])
    off = len(clip1) / 16
    s2, e2 = s2 + off, e2 + off

    buf = InputAudioBuffer()
    vad = StreamingVAD()
    segs, events = [], []
    # Drive it like the gateway: 24 kHz pcm16 appends (40 ms), the buffer's 16 kHz copy feeds the VAD.
    pcm24 = float_to_int16(resample(clip, RATE, 24000))
    for i in range(0, len(pcm24), 960):
        new16 = buf.append_b64(b64encode(pcm16_encode(pcm24[i : i + 960])))
        for ev in vad.feed(new16):
            events.append(ev)
            if ev.type == "speech_stopped":
                segs.append(buf.commit_range(ev.audio_start_ms, ev.audio_end_ms))
        if not vad.speaking:
            buf.discard_before(vad.position_ms - 300)
    assert [e.type for e in events] == ["speech_started", "speech_stopped"] * 2
    for ev_start, ev_stop, (s, e) in ((events[0], events[1], (s1, e1)), (events[2], events[3], (s2, e2))):
        assert abs(ev_start.audio_start_ms + 300 - s) <= TOL_MS
        assert abs(ev_stop.audio_end_ms - e) <= TOL_MS
    for seg, ev in zip(segs, (events[1], events[3])):
        assert (seg.audio_start_ms, seg.audio_end_ms) == (ev.audio_start_ms, ev.audio_end_ms)
        assert abs(len(seg.audio_16k) / 16 - seg.duration_ms) <= 1
    assert buf.duration_ms < 2000  # silence before speech was discarded as it went


def test_vad_sessions_do_not_share_state(piper_clip):
    clip, start, end = _place(piper_clip, 1000, 1000)
    silence = np.zeros_like(clip)
    one, two, ref = StreamingVAD(), StreamingVAD(), StreamingVAD()
    ev_one, ev_two = [], []
    # Interleave a speaking session with a silent one on the same shared model.
    for i in range(0, len(clip), 512):
        ev_one += one.feed(clip[i : i + 512])
        ev_two += two.feed(silence[i : i + 512])
    assert ev_two == [] and two.last_prob < 0.1
    assert ev_one == _feed(ref, clip, 512)


def test_vad_silence_noise_and_force_stop():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.003, RATE * 3).astype(np.float32)
    vad = StreamingVAD()
    assert _feed(vad, noise, 1000) == []
    assert vad.position_ms == 2976  # whole 32 ms windows consumed; the rest waits
    speech = espeak_speech("this is an open turn")
    ev = _feed(vad, speech, 800)
    assert [e.type for e in ev] == ["speech_started"]
    stop = vad.force_stop()
    assert stop.type == "speech_stopped" and stop.audio_end_ms > stop.audio_start_ms


def test_vad_parameters():
    assert [semantic_vad_silence_ms(e) for e in ("low", "medium", "high", "auto", None)] == [1200, 800, 500, 800, 800]
    with pytest.raises(ValueError):
        semantic_vad_silence_ms("eager")
    with pytest.raises(ValueError):
        StreamingVAD(threshold=1.5)


@pytest.mark.parametrize("noise_db", [None, -60])
def test_vad_end_is_where_the_voice_stops(noise_db):
    """Silero's probability stays high ~60-150 ms after a voice stops; the windows that were already TAIL_DB below the
    turn's loudest count as silence, so audio_end_ms is the voice's end and speech_stopped comes silence_duration_ms
    after it (not after silero's lag). Also under a noise floor 60 dB down."""
    rng = np.random.default_rng(1)
    for speech in (steady_piper_speech("How many legs does a spider have?"), espeak_speech("tell me a short story")):
        clip, _, end = _place(speech, 300, 1000)
        if noise_db is not None:
            clip = clip + rng.normal(0, 10 ** (noise_db / 20), len(clip)).astype(np.float32)
        vad = StreamingVAD(silence_duration_ms=500)
        for i in range(0, len(clip), 512):
            ev = vad.feed(clip[i : i + 512])
            if ev and ev[-1].type == "speech_stopped":
                break
        assert ev[-1].type == "speech_stopped"
        assert abs(ev[-1].audio_end_ms - end) <= 40, (ev, end)
        assert 500 <= vad.position_ms - ev[-1].audio_end_ms < 500 + 32


def test_vad_end_under_louder_noise_keeps_silero_timing():
    """Noise less than TAIL_DB under the voice: no window counts as quiet, silero's own end stands."""
    rng = np.random.default_rng(2)
    clip, _, end = _place(espeak_speech("tell me a short story"), 300, 1200)
    clip = clip + rng.normal(0, 0.01, len(clip)).astype(np.float32)  # -40 dBFS
    ev = _feed(StreamingVAD(), clip, 512)
    assert [e.type for e in ev] == ["speech_started", "speech_stopped"]
    assert 0 <= ev[1].audio_end_ms - end <= TOL_MS, (ev, end)


def test_quiet_tail_reports_the_pause_before_silero():
    """A voice that stops is a pause (unconfirmed) once QUIET_PAUSE_MS of its quiet tail are in, before silero turns
    to silence; the pause silero then confirms starts at the same sample, so work started on the first is kept."""
    sooner = []
    for speech in (steady_piper_speech("How many legs does a spider have?"), espeak_speech("tell me a short story")):
        clip, _, end = _place(speech, 300, 1000)
        vad = StreamingVAD(silence_duration_ms=800)
        first = confirmed = None
        for i in range(0, len(clip), 512):
            vad.feed(clip[i : i + 512])
            pause = vad.pause
            if pause is None or i < end * 16:
                continue
            first = first or (vad.position_ms, pause)
            if pause.confirmed:
                confirmed = (vad.position_ms, pause)
                break
        assert confirmed is not None
        assert first[1].silence_start_ms == confirmed[1].silence_start_ms
        assert abs(first[1].silence_start_ms - end) <= 40, (first, end)
        sooner.append(confirmed[0] - first[0])
    assert max(sooner) >= 32, sooner
