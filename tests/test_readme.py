"""The README's snippets ("Connect" and every other one for the server), taken from the README itself, run against a
served instance, and its flag table lists every `rtserve serve` flag: the README and the code cannot drift apart.

The snippets are written for `make serve` (http://127.0.0.1:8000); the test swaps in the `server` fixture's address and
runs each one as a user would: curl in bash, Python in a fresh interpreter.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

README = Path(__file__).resolve().parents[1] / "README.md"
SERVE_ADDRESS = "127.0.0.1:8000"   # where `make serve` listens; every snippet says so


def section(title: str) -> str:
    """The README's text from the heading `## title` to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)


def server_snippets(text: str) -> tuple[list[str], list[str]]:
    """The curl (bash) and Python blocks of `text` that talk to `make serve`'s address."""
    blocks = [(lang, code) for lang, code in code_blocks(text) if SERVE_ADDRESS in code]
    curls = [code for lang, code in blocks if lang == "bash" and "curl " in code]
    pythons = [code for lang, code in blocks if lang == "python"]
    return curls, pythons


def run_snippet(args: list[str]) -> str:
    """Run a snippet pointed at `server`; its stdout. The timeout only guards a hang."""
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{args[-1]}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r.stdout


def at(server, code: str) -> str:
    return code.replace(SERVE_ADDRESS, f"{server.host}:{server.port}")


def test_readme_snippets_run_against_a_served_instance(server):
    curls, pythons = server_snippets(section("Connect"))
    assert len(curls) == 1 and len(pythons) == 2, "the Connect section lost a snippet"
    body = json.loads(run_snippet(["bash", "-c", at(server, curls[0])]))
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip()
    # the HTTP SDK call (plain and streamed), the Realtime SDK turn, then every other README snippet for the server
    for code in pythons + [code for code in server_snippets(README.read_text())[1] if code not in pythons]:
        out = run_snippet([sys.executable, "-c", at(server, code)])
        assert out.strip(), code
    asyncio.run(server.wait_idle())


def test_the_demo_is_where_the_readme_says():
    demo = [code for lang, code in code_blocks(section("Connect")) if "open http://" in code]
    assert len(demo) == 1 and f"http://{SERVE_ADDRESS}/" in demo[0]


def test_demo_page_is_served(server):
    page = httpx.get(f"{server.root_url}/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_flag_table_lists_every_serve_flag():
    from gateway import cli

    table = section("Command-line flags")
    listed = set(re.findall(r"`(--[a-z0-9-]+|[A-Z]+)`", "\n".join(
        line.split("|")[1] for line in table.splitlines() if line.startswith("| `"))))
    usage = cli.serve_parser().format_usage()   # every flag but the hidden aliases, and MODEL
    flags = set(re.findall(r"--[a-z0-9-]+", usage)) - {"--help"} | ({"MODEL"} if "[MODEL]" in usage else set())
    assert flags - listed == set(), "flags missing from the README's flag table"
    assert listed - flags == set(), "the README's flag table lists flags `rtserve serve` does not have"
