"""`rtserve bench throughput --sampling`: the settings it parses, what HF is given for the same draws, bad flags as one
line, and a sampled engine run end to end on the embedded model."""
from __future__ import annotations

import pytest

from bench import throughput
from gateway import cli


def test_sampling_spec_parses_into_sampling_params_fields():
    assert throughput.parse_sampling("temperature=0.2, top_p=0.9") == {"temperature": 0.2, "top_p": 0.9}
    assert throughput.parse_sampling("top_k=40,min_p=0.05") == {"top_k": 40, "min_p": 0.05}
    # HF draws with the same settings, and without its default top-k of 50 unless one is given
    assert throughput.hf_sampling({"temperature": 0.2, "top_p": 0.9}) == {"do_sample": True, "top_k": 0,
                                                                           "temperature": 0.2, "top_p": 0.9}
    assert throughput.hf_sampling({"top_k": 40})["top_k"] == 40
    assert throughput.hf_sampling(None) == {"do_sample": False}


@pytest.mark.parametrize("argv, message", [
    (["--sampling", "temperature=0"], "temperature must be > 0"),
    (["--sampling", "beam=4"], "'beam=4': expected KEY=VALUE"),
    (["--sampling", "top_p"], "'top_p': expected KEY=VALUE"),
    (["--sampling", "top_k=x"], "invalid literal"),
    (["--sampling", "top_p=0.9", "--engine-process"], "not with --speculative-config or --engine-process"),
])
def test_bad_sampling_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "throughput", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "--sampling" in err[-1], err


def test_sampled_run_end_to_end(capsys):
    """Two seeded requests drawn at the embedded model's defaults through the real engine: every request generates its
    whole output length (the bench asserts it), and the table says the workload was sampled."""
    assert cli.main(["bench", "throughput", "--sampling", "temperature=0.2,top_p=0.9", "--skip-hf",
                     "--num-requests", "2", "--repeats", "1", "--dtype", "bfloat16", "--no-gguf-row"]) == 0
    out = capsys.readouterr().out
    assert "sampled (temperature 0.2, top_p 0.9)" in out and "| bfloat16 |" in out
