"""End-of-turn benchmark: how often each rule ends a turn early on complete utterances, how often it ends one falsely
on utterances paused at an incomplete point, and how soon after the end of speech it decides.

    rtserve bench turn [--limit N] [--dump FILE] [--voice espeak]         (runs the models)
    rtserve bench turn --scores FILE [--as-heard] [--no-heard-ending]   (replays a dump under the rule in the code)

Two sets, synthesized now with piper (joe-us, its own noise on every clip; nothing recorded), or with `--voice espeak`
espeak-ng's en-us (flat phrase endings, a voice the rule was not tuned on): COMPLETE questions and
statements, and PAUSED utterances cut at an incomplete point ("of", "and", "the", "um", mid-clause) by a 300-700 ms
pause, then continued. Each clip runs through the server's own pieces, in process: the silero VAD (`StreamingVAD`,
its pauses as `AudioInput` reports them), and at each pause of SCORED_FROM_MS or more, Whisper on the turn so far, the
engine's prefill of the reply prompt with the end-of-turn positions scored (`prompt_logprob_positions`, the chat
template, the voice session's instructions), and Smart Turn on the audio; each timed. Rules, at eagerness medium
(turn_detection.EAGERNESS, its falling threshold):
- fixed 500 ms: server_vad's window, no early end;
- end-of-turn token alone, text alone (the token jointly with Whisper's punctuation before it), Smart Turn alone;
- combined: `turn_detection.combine`, the server's rule (with P(a sentence ends after the words) from the same
  prefill's top logprobs, and Whisper's certainty of the transcript's ending, `WhisperModel.heard_ending`; a dump
  written before either had none, and replays the rule without it).
A rule ends a turn at a pause at the first silence at which the scores it needs are in (`Pause.ready_ms`: the VAD's
report, then Whisper + prefill, then Smart Turn where the server would ask it) and its probability clears the threshold for that silence
(`turn_detection.early_end_ms`), or when the pause lasts the window (800 ms for semantic_vad medium). Reported for
all clips, the tuning half (even ids) and the held-out half (odd ids): early ends on COMPLETE (the turn ended before
the window), false ends on PAUSED (the turn ended inside its pause), and the median detection delay on COMPLETE from
the end of speech (−40 dB) to the decision; then where the time to the scores goes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

COMPLETE = [
    "What is the capital of France?", "Can you help me with my homework?", "Tell me a joke about cats.",
    "How tall is Mount Everest?", "What time is it in Tokyo?", "I would like to book a table for two.",
    "Please turn off the lights in the kitchen.", "Who wrote Romeo and Juliet?", "What is the weather like today?",
    "Set a timer for ten minutes.", "How do I make pancakes?", "Play some relaxing music.",
    "What is two plus two?", "Thank you, that was very helpful.", "Where is the nearest train station?",
    "How many legs does a spider have?", "Remind me to call my mother tomorrow.", "What does a koala eat?",
    "Can you recommend a good book?", "I am feeling a bit tired today.", "Why is the sky blue?",
    "Translate hello into Spanish.", "What is the speed of light?", "How far away is the moon?",
    "Send a message to Sarah saying I am late.", "What is the largest ocean on Earth?", "Is it going to rain tomorrow?",
    "Add milk and eggs to my shopping list.", "Who painted the Mona Lisa?", "What is your name?",
    "How do you say thank you in French?", "My favourite colour is green.", "What year did the war end?",
    "Tell me something interesting about octopuses.", "How long should I boil an egg?", "Wake me up at seven.",
    "What is the population of Canada?", "Can you spell the word necessary?", "I think that is all for now.",
    "What is the square root of sixty four?", "Which planet is closest to the sun?", "Good morning, how are you?",
]
PAUSED = [
    ("What is the capital of", "France?"), ("I would like to book a table for", "four people tonight."),
    ("Can you tell me the", "time in London?"), ("I need to buy some eggs and", "a loaf of bread."),
    ("My favourite food is um", "probably pizza."), ("How many people live in", "New York City?"),
    ("Please send an email to", "my manager about the meeting."), ("The meeting is on", "Tuesday afternoon."),
    ("Could you play the song by", "the Beatles?"), ("I was thinking that we could", "go to the park."),
    ("What is the difference between", "a frog and a toad?"), ("Set an alarm for", "six thirty tomorrow."),
    ("Remind me to pick up the", "kids from school."), ("Who was the first person to", "walk on the moon?"),
    ("I want to learn how to", "play the guitar."), ("Tell me a story about a", "dragon and a knight."),
    ("The weather in Paris is", "usually mild in spring."), ("Can you explain how", "a rainbow forms?"),
    ("I am looking for a recipe for", "chocolate cake."), ("What is the best way to", "learn a new language?"),
    ("Turn the volume up to", "about fifty percent."), ("Um I think I would like", "a cup of tea."),
    ("Where can I find the", "nearest pharmacy?"), ("My brother and", "I are going fishing."),
    ("How long does it take to", "fly to Sydney?"), ("Add bananas and", "apples to the list."),
    ("I have a question about", "my bank account."), ("What would happen if", "the sun disappeared?"),
    ("Please call the", "restaurant and cancel."), ("I need directions to", "the airport."),
    ("Is it true that", "cats sleep all day?"), ("We should probably", "leave before it gets dark."),
    ("The name of the book is", "Pride and Prejudice."), ("Can you find me a hotel in", "Rome for Friday?"),
    ("What is the meaning of the", "word serendipity?"), ("I forgot to", "water the plants."),
    ("Book a flight from Boston to", "Chicago next week."), ("How do you make a", "paper airplane?"),
    ("The train leaves at um", "half past nine."), ("Tell me the score of the", "football game last night."),
    ("I would rather have", "coffee than tea."), ("Show me pictures of", "the Grand Canyon."),
]
INSTRUCTIONS = "You are a concise voice assistant. Answer in one short sentence."
RATE = 16_000
CHUNK_MS = 40
AS_HEARD = False  # --as-heard: replay without conditioning the text scores on the last word's end
NO_HEARD_ENDING = False  # --no-heard-ending: replay without Whisper's certainty of the transcript's ending
VOICES = {"piper": "piper joe-us", "espeak": "espeak-ng en-us"}  # --voice: who speaks the utterances
SCORED_FROM_MS = 100  # pauses at least this long are scored (shorter ones are gaps between words)


@dataclass(slots=True)
class Pause:
    silence_start_ms: int
    silence_ms: float  # how long the VAD's silence lasted (the clip's next speech, or its end)
    seen_ms: float = 0.0  # silence the VAD had counted when it first reported the pause (silero's lag shows here)
    # ... when silero heard the silence (a quiet tail is reported before it: audio.vad.QUIET_PAUSE_MS)
    confirmed_ms: float = 0.0
    transcript: str = ""
    eot_logprobs: list[float] | None = None  # the prefill's logprobs at end_of_turn_positions (punctuation.., token)
    p_sentence_end: float | None = None  # P(a sentence ends after the words), from the same prefill's top logprobs
    p_word_end: float | None = None  # P(the last word is over), likewise (turn_detection.word_end_probability)
    p_audio: float | None = None
    p_heard: float | None = None  # Whisper's certainty of the transcript's ending (WhisperModel.heard_ending)
    whisper_s: float = 0.0
    prefill_s: float = 0.0
    smart_s: float = 0.0

    @property
    def scored(self) -> bool:
        return self.p_audio is not None

    @property
    def p_text(self) -> float | None:
        """The server's text signal: the end-of-turn token jointly with Whisper's punctuation before it, given that
        the last word is over."""
        return self.at_word_end(float(np.exp(sum(self.eot_logprobs)))) if self.eot_logprobs else None

    @property
    def p_end(self) -> float | None:
        """P(a sentence ends after the words), given that the last word is over."""
        return self.at_word_end(self.p_sentence_end)

    def at_word_end(self, p: float | None) -> float | None:
        """`p` given the last word is over (turn_detection.at_word_end); as it is in a dump from before
        p_word_end, or under --as-heard (the rule without it, for a comparison on the same dump)."""
        from gateway.realtime.turn_detection import at_word_end

        if self.p_word_end is None or AS_HEARD:
            return p
        return at_word_end(p, self.p_word_end)

    @property
    def heard(self) -> float | None:
        """Whisper's certainty of the transcript's ending as the rule takes it (None in a dump from before it, or
        under --no-heard-ending)."""
        return None if NO_HEARD_ENDING else self.p_heard

    @property
    def p_token(self) -> float | None:
        """The end-of-turn token alone (after whatever punctuation Whisper wrote)."""
        return float(np.exp(self.eot_logprobs[-1])) if self.eot_logprobs else None

    def ready_ms(self, rule: str = "combined", policy=None) -> float:
        """Silence after which the scores `rule` needs are in, as the server would run them: the pause is reported at
        SPECULATE_AFTER_MS (or when the VAD first saw it), then Whisper and the prefill for a text score, and for the
        combined rule Smart Turn after them where its score can change the outcome (`turn_detection.audio_matters`,
        at `policy`, default eagerness medium)."""
        from gateway.realtime.speculation import SPECULATE_AFTER_MS
        from gateway.realtime.turn_detection import EAGERNESS, audio_matters

        reported = max(SPECULATE_AFTER_MS, self.seen_ms)
        if rule == "Smart Turn alone":
            return reported + 1000 * self.smart_s
        text = reported + 1000 * (self.whisper_s + self.prefill_s)
        if rule == "combined" and audio_matters(self.p_text, policy or EAGERNESS["medium"], self.p_end, self.heard):
            return text + 1000 * self.smart_s
        return text


@dataclass(slots=True)
class Clip:
    kind: str  # "complete" | "paused"
    index: int  # within its set: even ones tune the rule, odd ones are held out
    text: str
    end_of_speech_ms: float  # complete: the voice's end; paused: the end of the first part
    pauses: list[Pause] = field(default_factory=list)


def synthesize(kind: str, parts: tuple[str, ...], pause_ms: int, speaker: str = "piper") -> tuple[np.ndarray, float]:
    from audio.speech import espeak_speech, piper_speech, speech_bounds_ms

    lead = np.zeros(RATE * 300 // 1000, np.float32)
    tail = np.zeros(RATE * 1500 // 1000, np.float32)
    speak = piper_speech if speaker == "piper" else espeak_speech
    voice = [speak(t) for t in parts]
    if kind == "complete":
        _, off = speech_bounds_ms(voice[0])
        return np.concatenate([lead, voice[0], tail]), 300 + off
    first, second = voice
    on1, off1 = speech_bounds_ms(first)
    on2, _ = speech_bounds_ms(second)
    # the gap between the voices is pause_ms (cut around the voiced parts)
    first, second = first[: int(off1 * RATE / 1000)], second[int(on2 * RATE / 1000):]
    gap = np.zeros(RATE * pause_ms // 1000, np.float32)
    return np.concatenate([lead, first, gap, second, tail]), 300 + off1


def vad_pauses(audio: np.ndarray) -> list[tuple[int, float, float, float, np.ndarray]]:
    """The pauses inside the first speech segment as the server's VAD sees them: (silence start, silence length,
    silence counted when first seen, silence counted when silero confirmed it, the turn's audio up to the silence)."""
    from audio.vad import StreamingVAD
    from gateway.realtime.speculation import SPECULATE_AFTER_MS

    vad = StreamingVAD(silence_duration_ms=60_000)
    step = RATE * CHUNK_MS // 1000
    found: dict[tuple[int, int], list[float]] = {}
    for i in range(0, len(audio), step):
        vad.feed(audio[i:i + step])
        pause = vad.pause
        if pause is not None:
            seen = found.setdefault((pause.speech_start_ms, pause.silence_start_ms), [pause.silence_ms, 0.0, None])
            seen[1] = pause.silence_ms
            if seen[0] < SPECULATE_AFTER_MS:
                seen[0] = pause.silence_ms
            if pause.confirmed and seen[2] is None:
                seen[2] = pause.silence_ms
    return [(e, ms, first, ms if confirmed is None else confirmed, audio[int(s * RATE / 1000):int(e * RATE / 1000)])
            for (s, e), (first, ms, confirmed) in sorted(found.items()) if ms >= 60]


def score(clips: list[tuple[str, int, str, np.ndarray, float]]) -> list[Clip]:
    from audio import smart_turn
    from audio.whisper import get_whisper
    from engine import LLMEngine, SamplingParams
    from gateway.realtime.response import (SENTENCE_END_TOP, end_of_turn_positions, sentence_end_ids, stop_token_ids,
                                           word_continuation_ids)
    from gateway.realtime.turn_detection import sentence_end_probability, word_end_probability

    whisper = get_whisper()
    engine = LLMEngine(dtype="bfloat16", quantization="gguf", kv_cache_memory="128MiB")
    tok = engine.tokenizer
    stops = stop_token_ids(tok)
    ends = sentence_end_ids(tok, tuple(stops))
    goes_on = word_continuation_ids(tok)
    out = []
    for kind, index, text, audio, end_ms in clips:
        clip = Clip(kind, index, text, end_ms)
        for silence_start, silence_ms, seen_ms, confirmed_ms, turn in vad_pauses(audio):
            pause = Pause(silence_start, silence_ms, seen_ms, confirmed_ms)
            clip.pauses.append(pause)
            if silence_ms < SCORED_FROM_MS:  # a gap between words: no rule ends a turn in it
                continue
            t0 = time.perf_counter()
            pause.transcript, pause.p_heard = whisper.transcribe_heard([turn])[0]
            t1 = time.perf_counter()
            if pause.transcript:
                prompt = tok.apply_chat_template([{"role": "system", "content": INSTRUCTIONS},
                                                  {"role": "user", "content": pause.transcript}],
                                                 add_generation_prompt=True, tokenize=False)
                ids = tok.encode(prompt, add_special_tokens=False)
                positions = end_of_turn_positions(ids, stops, tok.decode)
                # one salt: the instructions stay cached, as in a session, and only the turn is prefilled
                engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprob_positions=positions,
                                                       prompt_logprobs=SENTENCE_END_TOP), cache_salt="bench-turn")
                while engine.has_unfinished():
                    for o in engine.step():
                        if o.prompt_logprobs:
                            pause.eot_logprobs = [float(o.prompt_logprobs[i]) for i in positions]
                            first = o.prompt_top_logprobs[positions[0]]
                            pause.p_sentence_end = sentence_end_probability(first, ends)
                            pause.p_word_end = word_end_probability(first, goes_on)
            t2 = time.perf_counter()
            pause.p_audio = smart_turn.score(turn)
            pause.whisper_s, pause.prefill_s, pause.smart_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        out.append(clip)
        print(f"  {kind:8} {text[:60]!r:64} " + "  ".join(
            f"@{p.silence_start_ms} {p.silence_ms:.0f}ms text {p.p_text if p.p_text is not None else float('nan'):.2f}"
            f" audio {p.p_audio:.2f}" for p in clip.pauses if p.scored), flush=True)
    return out


RULES = ("fixed 500 ms", "end-of-turn token alone", "text alone", "Smart Turn alone", "combined")


def probability(p: Pause, rule: str) -> float:
    from gateway.realtime.turn_detection import combine

    return {"end-of-turn token alone": p.p_token or 0.0, "text alone": p.p_text or 0.0,
            "Smart Turn alone": p.p_audio or 0.0,
            "combined": combine(p.p_text, p.p_audio, p.p_end, p.heard)}[rule]


def decide(clip: Clip, rule: str, policy=None, window_ms: int | None = None) -> tuple[int, str, float]:
    """Where `rule` ends the clip's turn: (index of the pause, "early" or "window", delay ms from the end of speech).
    The clips end in 1.5 s of silence, so every rule ends the last pause at the latest. A pause ends early at the
    first silence, once both scores are in, at which the rule's probability clears the policy's threshold for that
    silence (`turn_detection.early_end_ms`, re-checked as the silence grows)."""
    from audio.vad import SEMANTIC_EAGERNESS_MS
    from gateway.realtime.turn_detection import EAGERNESS, early_end_ms

    policy = policy or EAGERNESS["medium"]
    window = 500 if rule == "fixed 500 ms" else window_ms or SEMANTIC_EAGERNESS_MS["medium"]
    for i, p in enumerate(clip.pauses):
        if rule != "fixed 500 ms" and p.scored:
            at = early_end_ms(probability(p, rule), policy, window)
            if at is not None:
                at = max(at, p.ready_ms(rule, policy), p.confirmed_ms)  # only silero's silence ends a turn
                if at < min(p.silence_ms, window):
                    return i, "early", p.silence_start_ms + at - clip.end_of_speech_ms
        if p.silence_ms >= window or i == len(clip.pauses) - 1:
            return i, "window", p.silence_start_ms + window - clip.end_of_speech_ms
    return -1, "none", 0.0


def table(clips: list[Clip], policy=None, window_ms: int | None = None) -> list[str]:
    lines = ["| rule | early ends, complete | false ends, paused | detection delay p50, complete |", "|---|---|---|---|"]
    for rule in RULES:
        comp = [(c, decide(c, rule, policy, window_ms)) for c in clips if c.kind == "complete" and c.pauses]
        paus = [(c, decide(c, rule, policy, window_ms)) for c in clips if c.kind == "paused" and c.pauses]
        early = sum(i == len(c.pauses) - 1 and k == "early" for c, (i, k, _) in comp) / max(1, len(comp))
        cut = sum(i < len(c.pauses) - 1 for c, (i, _, _) in comp)  # ended at a gap between words
        false = sum(i < len(c.pauses) - 1 for c, (i, _, _) in paus) / max(1, len(paus))
        delays = [d for c, (i, _, d) in comp if i == len(c.pauses) - 1]
        lines.append(f"| {rule} | {100 * early:.0f} %" + (f" ({cut} cut between words)" if cut else "") +
                     f" | {100 * false:.0f} % | {statistics.median(delays) if delays else float('nan'):.0f} ms |")
    return lines


def timings(clips: list[Clip]) -> str:
    """Where the time between the silence's start and the decision goes, medians over the scored final pauses of
    the complete set."""
    last = [c.pauses[-1] for c in clips if c.kind == "complete" and c.pauses and c.pauses[-1].scored]
    med = lambda f: statistics.median(f(p) for p in last) if last else float("nan")  # noqa: E731
    return (f"median over {len(last)} complete turns: VAD saw the silence at {med(lambda p: p.seen_ms):.0f} ms, "
            f"Whisper {1000 * med(lambda p: p.whisper_s):.0f} ms, prefill {1000 * med(lambda p: p.prefill_s):.0f} ms, "
            f"Smart Turn {1000 * med(lambda p: p.smart_s):.0f} ms, the combined rule's scores in at "
            f"{med(lambda p: p.ready_ms()):.0f} ms of silence")


def report(clips: list[Clip]) -> None:
    for name, part in (("all", clips), ("even ids (tuning half)", [c for c in clips if c.index % 2 == 0]),
                       ("odd ids (held out)", [c for c in clips if c.index % 2 == 1])):
        print(f"\n{name}: {sum(c.kind == 'complete' for c in part)} complete, "
              f"{sum(c.kind == 'paused' for c in part)} paused")
        print("\n".join(table(part)), flush=True)
    print("\n" + timings(clips), flush=True)


def save(clips: list[Clip], path: str) -> None:
    with open(path, "w") as f:
        json.dump([{**{k: getattr(c, k) for k in ("kind", "index", "text", "end_of_speech_ms")},
                    "pauses": [{k: getattr(p, k) for k in Pause.__slots__} for p in c.pauses]} for c in clips], f,
                  indent=1)


def load(path: str) -> list[Clip]:
    with open(path) as f:   # (a dump from before p_sentence_end leaves it None)
        return [Clip(**{**c, "pauses": [Pause(**p) for p in c["pauses"]]}) for c in json.load(f)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rtserve bench turn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=0, help="only the first N utterances of each set (0: all)")
    ap.add_argument("--dump", metavar="FILE", help="write every pause's scores and timings to FILE (JSON)")
    ap.add_argument("--scores", metavar="FILE", help="report from scores dumped earlier instead of running the models")
    ap.add_argument("--as-heard", action="store_true",
                    help="text scores not conditioned on the last word's end (the rule before at_word_end)")
    ap.add_argument("--voice", choices=list(VOICES), default="piper",
                    help="who speaks the utterances: piper's joe-us (default) or espeak-ng's en-us (flat, robotic "
                         "phrase endings: a voice the rule was not tuned on)")
    ap.add_argument("--no-heard-ending", action="store_true",
                    help="combined rule without Whisper's certainty of the transcript's ending (the rule before it)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    global AS_HEARD, NO_HEARD_ENDING
    AS_HEARD, NO_HEARD_ENDING = args.as_heard, args.no_heard_ending
    if args.scores:
        report(load(args.scores))
        return 0
    complete = COMPLETE[:args.limit or None]
    paused = PAUSED[:args.limit or None]
    print(f"rtserve bench turn: {len(complete)} complete, {len(paused)} paused (300-700 ms), {VOICES[args.voice]}, "
          f"{os.cpu_count()} CPUs", flush=True)
    clips = []
    for i, text in enumerate(complete):
        audio, end = synthesize("complete", (text,), 0, args.voice)
        clips.append(("complete", i, text, audio, end))
    for i, (head, rest) in enumerate(paused):
        pause_ms = 300 + (i * 400 // max(1, len(paused) - 1))
        audio, end = synthesize("paused", (head, rest), pause_ms, args.voice)
        clips.append(("paused", i, f"{head} [{pause_ms} ms] {rest}", audio, end))
    scored = score(clips)
    if args.dump:
        save(scored, args.dump)
    report(scored)
    return 0


if __name__ == "__main__":
    sys.exit(main())
