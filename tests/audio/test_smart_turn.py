"""Smart Turn v3.2 (audio/smart_turn.py): our numpy features match Whisper's feature extractor, and the model scores
real speech."""
import numpy as np
from transformers import WhisperFeatureExtractor

from audio import smart_turn
from tests.audio.speech import steady_piper_speech


def test_features_match_whisper_feature_extractor():
    fe = WhisperFeatureExtractor(chunk_length=smart_turn.WINDOW_S)
    rng = np.random.default_rng(0)
    for seconds in (0.5, 3.0, 9.5):  # padded in front, and cut to the last 8 s
        clip = (rng.standard_normal(int(seconds * 16000)) * 0.1).astype(np.float32)
        last = np.pad(clip[-smart_turn.N_SAMPLES:], (max(0, smart_turn.N_SAMPLES - len(clip)), 0))
        ref = fe(last, sampling_rate=16000, padding="max_length", max_length=smart_turn.N_SAMPLES, truncation=True,
                 do_normalize=True, return_tensors="np").input_features[0]
        ours = smart_turn.features(clip)
        assert ours.shape == ref.shape == (80, 800)
        np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_scores_are_probabilities_of_real_speech():
    tail = np.zeros(3200, np.float32)
    complete = smart_turn.score(np.concatenate([steady_piper_speech("Can you help me with my homework?"), tail]))
    filler = smart_turn.score(np.concatenate([steady_piper_speech("I think that um"), tail]))
    assert 0.0 <= filler < 0.5 < complete <= 1.0


def test_model_comes_from_the_wheel_file_list():
    path = smart_turn.model_path()
    assert path.name == smart_turn.MODEL_FILE and path.stat().st_size > 1_000_000
