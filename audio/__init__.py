"""Audio stage of rtserve: codecs, resampling, input buffer, server VAD, Whisper, TTS.

Nothing here imports ``gateway``; everything heavy runs off the asyncio event loop.  Models load
once per process (``get_whisper()``, ``get_synthesizer()``, the silero ONNX session) and are
shared by all sessions; per-session objects only hold small state.

API for the gateway (one Realtime session in brackets, shared objects created at start-up)::

    from audio.codecs import AudioFormat, AudioError, AudioFormatError, parse_audio_format, encode_b64_audio
    from audio.buffer import InputAudioBuffer, AudioBufferError, CommittedAudio
    from audio.vad import StreamingVAD, VADEvent, semantic_vad_silence_ms
    from audio.transcriber import Transcriber, TranscriptionError
    from audio.tts import TTSWorker, TTSError
    from audio.chunker import SentenceChunker

    # process-wide (lifespan; audio.stage.AudioStage holds both): one Whisper worker thread, the TTS threads
    transcriber = Transcriber()                  # loads Whisper in its own thread; .close() on shutdown
    tts = TTSWorker()                            # await tts.warmup() optional; .close() on shutdown

    # per session
    fmt = parse_audio_format(session_fmt)        # GA {"type": "audio/pcm", "rate": 24000} | {"type": "audio/pcmu"}
                                                 # | {"type": "audio/pcma"}; beta "pcm16" | "g711_ulaw" | "g711_alaw"
    buf = InputAudioBuffer(fmt)                  # buf.set_format(new) on session.update
    vad = StreamingVAD(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
                                                 # semantic_vad: silence_duration_ms=semantic_vad_silence_ms(eagerness)

    # input_audio_buffer.append {audio}  (run in a worker thread: decode + resample + VAD)
    new16k = buf.append_b64(audio)               # -> np.float32 @16 kHz; raises AudioFormatError / AudioBufferError
    for ev in vad.feed(new16k):                  # -> list[VADEvent]
        ev.type, ev.audio_start_ms               # "speech_started": audio_start_ms includes prefix padding
        ev.audio_end_ms                          # "speech_stopped": segment [audio_start_ms, audio_end_ms)
        seg = buf.commit_range(ev.audio_start_ms, ev.audio_end_ms)   # on speech_stopped -> CommittedAudio
    if not vad.speaking: buf.discard_before(vad.position_ms - prefix_padding_ms)   # keep memory flat
    vad.pause                                    # Pause(speech_start_ms, silence_start_ms, silence_ms) or None:
                                                 # a silence inside the turn, shorter than the window so far

    # input_audio_buffer.commit / .clear (manual turns)
    seg = buf.commit()                           # CommittedAudio(audio_16k, audio_start_ms, audio_end_ms);
                                                 # < 100 ms -> AudioBufferError(code="input_audio_buffer_commit_empty")
    buf.clear(); vad.reset(position_ms=buf.timeline_ms)   # keep the VAD on the buffer's clock

    # transcription (async, append-only deltas, a final transcript)
    stream = transcriber.transcribe(seg.audio_16k)   # TranscriptionStream; raises TranscriptionError on bad input
    async for delta in stream: ...               # ...input_audio_transcription.delta
    stream.text                                  # ...input_audio_transcription.completed (== "".join(deltas))
    text = await transcriber.transcribe_text(seg.audio_16k)
    # Cancelling/abandoning the consumer drops the request at the next decode step; errors raise
    # TranscriptionError out of the iteration (-> ...input_audio_transcription.failed).

    # speech out: LLM text deltas -> speakable pieces -> audio in the session's output format
    chunker = SentenceChunker()
    for piece in chunker.push(text_delta) (+ chunker.flush() at the end):
        job = tts.submit(piece, out_fmt, speed=1.0, clock=reply_clock)   # one SpeechClock per reply
        async for raw in job.chunks():           # bytes (pcm16 LE 24 kHz or G.711 8 kHz) as each window is vocoded
            base64.b64encode(raw) -> response.output_audio.delta
        job.cancel()                             # barge-in: the rest is never synthesized
        raw = await tts.speak_format(piece, out_fmt)   # or all at once; pcm = await tts.speak(piece, rate=24000)

Errors all derive from ``AudioError`` (``.code``, ``.message``, ``.param`` for the error event) except
``TranscriptionError``/``TTSError`` (RuntimeError subclasses with a ``code``).  ``transcriber.stats``
(``TranscriberStats.snapshot()``) has batch sizes, encoder/decoder seconds, audio seconds and RTF.

Environment (kernels/settings.py lists every variable): ``RTSERVE_CACHE`` holds the converted Whisper weights and the
piper voice split into encoder and vocoder; ``RTSERVE_WHISPER_DTYPE``, ``RTSERVE_WHISPER_THREADS``,
``RTSERVE_TTS_THREADS``, ``RTSERVE_TTS_LOOKAHEAD_S`` and ``RTSERVE_TTS_YIELD_SLACK_S`` tune the workers. They are
read when a worker or model is created.
"""
