"""`rtserve bench whisper`: real speech through the server's Whisper and the exact fp32 one."""
from __future__ import annotations

import json

import pytest

from bench import whisper


def test_bench_whisper_reports_both_models(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert whisper.main(["--limit", "1", "--floors", "450", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| server |" in table and "| fp32 |" in table and "| server, floor 450 |" in table
    result = json.loads(out.read_text())
    by_model = {s["model"]: s for s in result["summary"]}
    assert set(by_model) == {"server", "fp32", "server, floor 450"}
    for s in by_model.values():
        assert s["clips"] == 3 and set(s["wer_by_voice"]) == {"piper", "espeak"}   # 2 piper + 1 espeak
        assert s["wer"] <= 0.3 and s["loops"] == 0 and s["encoder_ms_p50"] > 0 and s["decoder_ms_p50"] > 0
    assert [ref for _, ref, _ in result["transcripts"]["server"]][0] == "What is the capital of France?"


@pytest.mark.parametrize("floors", ["10", "x,400"])
def test_bench_whisper_refuses_bad_floors(floors):
    with pytest.raises(SystemExit) as exc:
        whisper.main(["--floors", floors])
    assert exc.value.code == 2
