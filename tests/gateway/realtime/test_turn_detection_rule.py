"""The end-of-turn rule itself (gateway/realtime/turn_detection.py), without models: the threshold falls as the
silence grows, so a sure end is taken at the shortest silence and a doubtful one later; the text signal vetoes, unless
both signals agree that a sentence ends here."""
from __future__ import annotations

import pytest

from gateway.realtime.turn_detection import (EAGERNESS, HEARD_SURE, TEXT_VETO, WORD_END_MIN, Eagerness, at_word_end,
                                             audio_matters, combine, early_end_ms, word_end_probability)

WINDOW = 800


def test_the_threshold_falls_from_the_shortest_silence_to_the_window():
    policy = Eagerness(200, 0.6, 0.2)
    assert policy.threshold_at(0, WINDOW) == pytest.approx(0.6)  # before the shortest silence: no lower
    assert policy.threshold_at(200, WINDOW) == pytest.approx(0.6)
    assert policy.threshold_at(500, WINDOW) == pytest.approx(0.4)
    assert policy.threshold_at(800, WINDOW) == pytest.approx(0.2)
    assert policy.threshold_at(2000, WINDOW) == pytest.approx(0.2)


def test_a_sure_end_at_the_shortest_silence_a_doubtful_one_later_an_unlikely_one_never():
    policy = Eagerness(200, 0.6, 0.2)
    assert early_end_ms(0.9, policy, WINDOW) == 200
    assert early_end_ms(0.6, policy, WINDOW) == 200
    assert early_end_ms(0.4, policy, WINDOW) == pytest.approx(500)
    assert early_end_ms(0.19, policy, WINDOW) is None
    # the later the end, the lower the probability it needs (re-checks as the silence grows)
    times = [early_end_ms(p / 100, policy, WINDOW) for p in range(21, 61)]
    assert times == sorted(times, reverse=True)
    # the probability that ends a pause after s ms is the threshold at s
    for p in (0.25, 0.35, 0.5):
        assert policy.threshold_at(early_end_ms(p, policy, WINDOW), WINDOW) == pytest.approx(p)


def test_no_early_end_past_the_window_or_with_a_window_shorter_than_the_shortest_silence():
    policy = Eagerness(200, 0.6, 0.2)
    assert early_end_ms(0.9, policy, 150) is None  # the VAD's window ends the turn first
    flat = Eagerness(200, 0.5, 0.5)  # no fall: one check only
    assert early_end_ms(0.5, flat, WINDOW) == 200 and early_end_ms(0.49, flat, WINDOW) is None


def test_the_text_signal_leads_and_vetoes():
    assert combine(None, 0.99) == 0.0  # no transcript: audio alone ends nothing
    assert combine(TEXT_VETO / 2, 0.99) == 0.0
    assert combine(0.9, None) == 0.9
    # past the veto the audio moves the text score, less than the text does
    assert combine(0.5, 0.0) < combine(0.5, 1.0)
    assert combine(1.0, 0.0) > combine(0.0 + TEXT_VETO, 1.0)


def test_both_signals_agreeing_on_a_sentence_end_override_the_veto():
    """"who wrote Romito and Juliet" (a misheard name, no "?"): the joint text score vetoes, but a "?" was likely
    after the words and the voice sounds finished; "What is the capital of" in a flat voice: the audio says complete,
    the words do not end a sentence; Whisper's "The train leaves at home." on a cut utterance: the words could end, the
    voice does not."""
    policy = EAGERNESS["medium"]
    assert combine(1e-5, 0.9, 0.6) == pytest.approx(0.54)
    assert early_end_ms(combine(1e-5, 0.9, 0.6), policy, WINDOW) == policy.min_silence_ms
    assert early_end_ms(combine(1e-6, 0.98, 0.002), policy, WINDOW) is None
    assert early_end_ms(combine(0.02, 0.2, 0.16), policy, WINDOW) is None
    assert combine(1e-5, None, 0.9) == 0.0  # no audio score: the text alone decides, and vetoes
    assert combine(0.9, 0.1, 0.95) == pytest.approx(0.8 * 0.9 + 0.2 * 0.1)  # the higher of the two ways
    assert combine(0.06, 0.9, 0.9) == pytest.approx(0.81)


def test_the_text_scores_are_taken_given_that_the_last_word_is_over():
    """"...Romeo and Juliet" where the model expects "te" (Juliette): the mass on the word going on is taken out, so the
    end-of-turn token and a sentence end are read among the ways the word can be over."""
    import math

    te, tes, by, qm = 1, 2, 3, 4
    top = [(te, math.log(0.80)), (by, math.log(0.05)), (qm, math.log(0.05)), (tes, math.log(0.05))]
    p_word_end = word_end_probability(top, frozenset({te, tes}))
    assert p_word_end == pytest.approx(0.15)
    assert at_word_end(0.05, p_word_end) == pytest.approx(1 / 3)
    assert at_word_end(0.5, p_word_end) == 1.0  # a probability still
    assert at_word_end(None, p_word_end) is None and at_word_end(0.3, None) == 0.3  # unscored: as it was
    assert word_end_probability(top, frozenset()) == 1.0  # nothing goes on with the word: as heard
    assert word_end_probability([(te, 0.0)], frozenset({te})) == WORD_END_MIN  # a bounded rise, however sure


@pytest.mark.parametrize("eagerness", sorted(EAGERNESS))
def test_every_eagerness_is_a_falling_threshold_inside_the_unit_interval(eagerness):
    policy = EAGERNESS[eagerness]
    assert 0.0 <= policy.floor <= policy.threshold <= 1.0 and policy.min_silence_ms > 0


@pytest.mark.parametrize("eagerness", sorted(EAGERNESS))
def test_the_audio_is_asked_only_where_it_can_change_when_the_turn_ends(eagerness):
    """Smart Turn is skipped exactly where every audio score gives the same early end (or none), at every silence
    window; where it is asked, some audio score moves the end."""
    policy = EAGERNESS[eagerness]
    assert not audio_matters(None, policy) and not audio_matters(TEXT_VETO / 2, policy)
    assert not audio_matters(TEXT_VETO / 2, policy, policy.floor / 2)  # and no sentence can end here
    assert audio_matters(TEXT_VETO / 2, policy, 0.5)  # vetoed, but the words could end a sentence: ask
    assert not audio_matters(0.99, policy)  # a sure text score ends the turn at the shortest silence anyway
    asked = 0
    for p_heard in (None, 0.5, 0.95):
        for p_end in (None, 0.0, 0.04, 0.3, 1.0):
            for p_text in [i / 200 for i in range(201)]:
                for window in (policy.min_silence_ms + 1, 500, 800, 1200):
                    ends = {early_end_ms(combine(p_text, a / 20, p_end, p_heard), policy, window) for a in range(21)}
                    if not audio_matters(p_text, policy, p_end, p_heard):
                        assert len(ends) == 1, (p_text, p_end, p_heard, window, ends)
                    elif window == 1200:
                        assert len(ends) > 1, (p_text, p_end, p_heard, ends)
                        asked += 1
    assert asked > 0


def test_text_scores_count_as_far_as_whisper_heard_the_ending():
    """Whisper's "The train leaves at home." on a cut "The train leaves at um": a complete-looking sentence, whose
    last word Whisper guessed in the silence. Both text scores are scaled by how sure it was of that ending."""
    policy = EAGERNESS["medium"]
    assert combine(0.5, 0.5, 0.6, None) == combine(0.5, 0.5, 0.6)  # unknown: as before
    assert combine(0.5, 0.5, 0.6, 1.0) == pytest.approx(combine(0.5, 0.5, 0.6))
    assert combine(0.5, 0.5, 0.6, 0.5) == pytest.approx(combine(0.25, 0.5, 0.3))
    # a sure text score on a guessed ending: under the veto, and the agreement term falls with it
    assert combine(0.09, 0.8, 0.6, 0.5) == pytest.approx(0.6 * 0.5 * 0.8)
    guessed = combine(0.2, 0.9, 0.16, 0.2)
    assert early_end_ms(combine(0.2, 0.9, 0.16), policy, WINDOW) is not None and \
        early_end_ms(guessed, policy, WINDOW) is None
    # whether Smart Turn is asked follows the scaled scores
    assert audio_matters(0.1, policy, 0.0) and not audio_matters(0.1, policy, 0.0, 0.1)


def test_a_sentence_end_whisper_is_sure_of_lets_the_voice_end_the_turn_late():
    """"What colors the sky?" (Whisper's mishearing of "What color is the sky?", sure of its "?"): the text model reads
    "What colors the sky" as unfinished (the joint score vetoes, no sentence end among its top tokens), but the voice
    sounds finished. The turn ends late in the window, not at the window; never at the shortest silence, and not when
    Whisper guessed the ending or the voice sounds unfinished."""
    policy = EAGERNESS["medium"]
    sky = early_end_ms(combine(6e-5, 0.9, 0.0, 0.93), policy, WINDOW)
    assert sky is not None and 450 < sky < 650, sky
    assert early_end_ms(combine(6e-5, 0.9, 0.0, HEARD_SURE - 0.05), policy, WINDOW) is None  # an ending it guessed
    assert early_end_ms(combine(6e-5, 0.3, 0.0, 0.93), policy, WINDOW) is None  # a voice that sounds unfinished
    assert combine(6e-5, None, 0.0, 0.93) == 0.0  # no audio score: the text alone decides
    assert audio_matters(6e-5, policy, 0.0, 0.93) and not audio_matters(6e-5, policy, 0.0, HEARD_SURE - 0.05)
    for name in ("auto", "medium", "low"):
        p = EAGERNESS[name]
        assert all(early_end_ms(combine(1e-6, a / 20, 0.0, 1.0), p, WINDOW) != p.min_silence_ms for a in range(21))
    # the sooner the surer the voice
    assert early_end_ms(combine(6e-5, 1.0, 0.0, 0.93), policy, WINDOW) < sky
