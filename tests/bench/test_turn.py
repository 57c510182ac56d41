"""rtserve bench turn: both voices run through the server's pieces, and a dump replays under the rule."""
from __future__ import annotations

import json

from bench import turn


def test_bench_turn_speaks_with_espeak_and_replays_its_dump(tmp_path, capsys):
    dump = tmp_path / "scores.json"
    assert turn.main(["--limit", "2", "--voice", "espeak", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "2 complete, 2 paused (300-700 ms), espeak-ng en-us" in out and "| combined |" in out
    clips = json.loads(dump.read_text())
    assert [c["kind"] for c in clips] == ["complete", "complete", "paused", "paused"]
    for c in clips:  # every clip's last pause is the end of its speech, scored by all three signals
        last = c["pauses"][-1]
        assert last["transcript"] and last["eot_logprobs"] and last["p_audio"] is not None, c
        assert 0.0 < last["p_heard"] <= 1.0, c  # Whisper's certainty of the transcript's ending
    paused = clips[2]
    assert len(paused["pauses"]) >= 2 and paused["pauses"][0]["silence_ms"] >= 250, paused  # the 300 ms cut
    assert turn.main(["--scores", str(dump)]) == 0
    assert "| combined |" in capsys.readouterr().out
    assert turn.main(["--scores", str(dump), "--no-heard-ending"]) == 0  # the rule before Whisper's certainty
    assert "| combined |" in capsys.readouterr().out
