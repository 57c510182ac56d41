"""`rtserve bench whisper`: real speech through the server's Whisper and the exact fp32 one."""
from __future__ import annotations

import json

import pytest

from bench import whisper


def test_bench_whisper_reports_both_models(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert whisper.main(["--limit", "1", "--floors", "450", "--batches", "1,2", "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| server |" in table and "| fp32 |" in table and "| server, floor 450 |" in table
    assert "| server, whole context computed |" in table  # the encoder before its silence tail, as the baseline
    assert "| encoder batch |" in table
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["encoder_batches"]] == [1, 2]
    assert result["encoder_batches"][0]["vs_first"] == 1 and all(r["encoder_ms_per_clip"] > 0 and r["groups"] == 3
                                                                 for r in result["encoder_batches"])
    by_model = {s["model"]: s for s in result["summary"]}
    assert set(by_model) == {"server", "server, whole context computed", "fp32", "server, floor 450"}
    for s in by_model.values():
        assert s["clips"] == 3 and set(s["wer_by_voice"]) == {"piper", "espeak"}   # 2 piper + 1 espeak
        assert s["wer"] <= 0.3 and s["loops"] == 0 and s["encoder_ms_p50"] > 0 and s["decoder_ms_p50"] > 0
    assert [ref for _, ref, _ in result["transcripts"]["server"]][0] == "What is the capital of France?"


@pytest.mark.parametrize("flags", [["--floors", "10"], ["--floors", "x,400"], ["--batches", "0"],
                                   ["--batches", "1,x"]])
def test_bench_whisper_refuses_bad_flags(flags):
    with pytest.raises(SystemExit) as exc:
        whisper.main(flags)
    assert exc.value.code == 2
