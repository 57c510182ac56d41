"""README's configuration table is the registry's (kernels/settings.py), and values are read when asked."""
from __future__ import annotations

from pathlib import Path

from kernels import settings

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_table() -> str:
    """The first markdown table after the heading "## Configuration"."""
    lines = README.read_text().splitlines()
    assert "## Configuration" in lines, "README has no configuration section"
    start = lines.index("## Configuration")
    table = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return "\n".join(table)


def test_readme_lists_every_variable_as_the_registry_does():
    assert _readme_table() == settings.markdown_table()


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.delenv("RTSERVE_PACKED_LINEAR", raising=False)
    assert settings.enabled("RTSERVE_PACKED_LINEAR")
    monkeypatch.setenv("RTSERVE_PACKED_LINEAR", "0")
    assert not settings.enabled("RTSERVE_PACKED_LINEAR")
    monkeypatch.setenv("RTSERVE_TTS_THREADS", "3")
    assert settings.integer("RTSERVE_TTS_THREADS") == 3
    monkeypatch.setenv("RTSERVE_TTS_THREADS", "")           # empty means unset: the default
    assert settings.integer("RTSERVE_TTS_THREADS") == int(settings.VARIABLES["RTSERVE_TTS_THREADS"].default)
