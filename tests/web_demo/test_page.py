"""End-to-end test of the browser demo (web_demo/) in a real headless Chromium against the real gateway.

Chromium's fake microphone plays a wav of words spoken by espeak-ng; the page streams it through its AudioWorklet to
/v1/realtime, the gateway's VAD/Whisper/LLM/TTS answer, and we watch the page: transcript, reply text, audio playback
(Playwright mutes the output, but the audio clock runs, so the page sees its own playback progress), barge-in and a typed
turn; the conversation's order, the event log, the settings sent in session.update and a tool call shown in its turn.
Screenshots go to $RTSERVE_ARTIFACTS/web_demo/ (default: a folder in the system's temp dir), not into the repository.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kernels import settings

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(settings.raw("RTSERVE_ARTIFACTS") or Path(tempfile.gettempdir()) / "rtserve-artifacts") / "web_demo"
CHROMIUM = "/usr/bin/chromium"
RTSERVE = Path(sys.executable).parent / "rtserve"

# Spoken prompt: asks for a long answer so that there is still reply audio playing when we talk over it.
SPOKEN = "Tell me a long story about a dragon."
SPOKEN_KEYWORDS = ("story", "dragon")
TYPED = "What is the capital of France?"
MAX_TOKENS = 40     # typed turns: short replies
STORY_TOKENS = 120  # the story we talk over: long enough to still be playing
EVENT_TYPES = "ls => ls.map(l => l.dataset.dir + ' ' + l.dataset.type)"   # the event log: "client|server TYPE"
STORYTELLER = "You are a storyteller. Always answer with a long and detailed story of at least ten sentences."

pytestmark = pytest.mark.slow  # every wait below is bounded; the whole file takes about 1-3 minutes


# ------------------------------------------------------------------------------------------------------------ fixtures
def _apt_install(*pkgs: str) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", *pkgs], check=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def system_tools() -> None:
    """Debian chromium (Playwright's own browser download does not work here), espeak-ng and sox."""
    missing = [pkg for pkg, exe in (("chromium", CHROMIUM), ("espeak-ng", "espeak-ng"), ("sox", "sox"))
               if not (Path(exe).exists() if exe.startswith("/") else shutil.which(exe))]
    if missing:
        _apt_install(*missing)


@pytest.fixture(scope="module")
def out_dir() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


@pytest.fixture(scope="module")
def speech_wav(system_tools, out_dir: Path) -> tuple[Path, float]:
    """Spoken words as 16-bit PCM mono 24 kHz (Chromium plays 24-bit fake-mic files as silence), 0.3 s of silence
    before and 1.5 s after so server VAD sees the end of the turn."""
    raw = out_dir / "spoken_raw.wav"
    wav = out_dir / "spoken.wav"
    subprocess.run(["espeak-ng", "-s", "150", "-w", str(raw), SPOKEN], check=True, timeout=60)
    subprocess.run(["sox", str(raw), "-b", "16", "-e", "signed-integer", "-c", "1", "-r", "24000", str(wav),
                    "pad", "0.3", "1.5"], check=True, timeout=60)
    dur = float(subprocess.run(["soxi", "-D", str(wav)], check=True, capture_output=True, text=True).stdout)
    assert dur > 2.0
    return wav, dur


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_gateway(out_dir: Path, *args: str, log_name: str = "gateway.log"):
    """The real gateway (`rtserve serve`) on a free port of 127.0.0.1 (a secure context, so getUserMedia works)."""
    port = _free_port()
    log = open(out_dir / log_name, "wb")
    proc = subprocess.Popen([str(RTSERVE), "serve", "--host", "127.0.0.1", "--port", str(port), *args],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rtserve exited with {proc.returncode}; see {out_dir / log_name}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rtserve did not become healthy; see {out_dir / log_name}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def gateway(out_dir: Path):
    with run_gateway(out_dir) as base:
        yield base


@pytest.fixture(scope="module")
def browser(system_tools, speech_wav):
    from playwright.sync_api import sync_playwright

    wav, _ = speech_wav
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}%noloop",
            ],
        )
        try:
            yield b
        finally:
            b.close()


class Page:
    """A fresh page on the demo, with page errors and console errors collected."""

    def __init__(self, browser, base: str, **context_args):
        self.ctx = browser.new_context(**context_args)
        self.ctx.grant_permissions(["microphone"], origin=base)
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.console: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.goto(base + "/")

    def state(self) -> dict:
        return self.page.evaluate("window.rtserveDemo.state")

    def wait(self, js: str, timeout_s: float, what: str):
        try:
            self.page.wait_for_function(js, timeout=timeout_s * 1000, polling=100)
        except Exception as e:  # add the page's state and console to the failure
            raise AssertionError(f"timed out waiting for {what}: {js}\nstate={json.dumps(self.state())}\n"
                                 f"console={self.console[-20:]}\nerrors={self.errors}") from e

    def tid(self, name: str):
        return self.page.get_by_test_id(name)

    def connect(self):
        self.tid("connect").click()
        self.wait("window.rtserveDemo.state.connected", 30, "the session to start")
        assert self.tid("status").get_attribute("data-state") == "connected"
        assert self.tid("status").inner_text().strip() == "Connected"
        assert self.state()["subprotocol"] == "realtime"  # offered by the page, echoed by the server

    def toggle_settings(self):
        self.page.locator("#settings summary").click()

    def settings(self, *, voice=None, vad=None, instructions=None, max_tokens=None):
        """Fill the Settings panel like a user (before connecting; they go out in session.update)."""
        self.toggle_settings()
        if voice is not None:
            self.tid("voice").set_checked(voice)
        if vad is not None:
            self.tid("vad-toggle").set_checked(vad)
        if instructions is not None:
            self.tid("instructions").fill(instructions)
        if max_tokens is not None:  # keeps the tiny model from rambling on for minutes
            self.tid("max-tokens").fill(str(max_tokens))
        self.toggle_settings()

    def typed_turn(self, text: str) -> str:
        before = self.state()["turns"]
        self.tid("text-input").fill(text)
        self.tid("send").click()
        self.wait(f"window.rtserveDemo.state.turns > {before}", 60, "the typed turn to start")
        assert self.tid("user-transcript").inner_text().strip() == text
        self.wait("(s => !s.responseActive && s.assistantText.trim().length > 0)(window.rtserveDemo.state)", 120,
                  "the reply to the typed turn")
        reply = self.tid("assistant-text").inner_text().strip()
        assert reply, "empty reply text"
        return reply

    def close(self):
        self.ctx.close()


# --------------------------------------------------------------------------------------------------------------- tests
def test_page_controls_and_typed_turn(gateway, browser, out_dir):
    """The page loads at /, exposes its hooks, connects with the `realtime` subprotocol, and a typed turn (voice off:
    output_modalities ["text"]) streams a reply; it stays readable at phone width."""
    pg = Page(browser, gateway, viewport={"width": 1000, "height": 900})
    try:
        for tid in ("connect", "mic", "text-input", "send", "user-transcript", "assistant-text", "status"):
            assert pg.tid(tid).count() == 1, f"data-testid={tid} missing"
        s = pg.state()
        for key in ("connected", "playbackStarted", "lastLatencyMs", "error"):
            assert key in s
        assert s["connected"] is False and s["error"] is None
        assert pg.tid("status").get_attribute("data-state") == "disconnected"
        # state is read-only: writes do not stick
        pg.page.evaluate("() => { try { window.rtserveDemo.state.connected = true } catch (e) {} }")
        assert pg.state()["connected"] is False

        pg.settings(voice=False, max_tokens=MAX_TOKENS)  # text-only replies
        pg.connect()
        reply = pg.typed_turn(TYPED)
        s = pg.state()
        assert s["error"] is None, s["error"]
        assert isinstance(s["lastLatencyMs"], (int, float)) and s["lastLatencyMs"] > 0
        assert s["playbackStarted"] is False  # text-only: no audio was played
        assert re.search(r"text \d+ ms", pg.tid("latency").inner_text())
        print(f"typed turn reply: {reply!r}; latency {s['lastLatencyMs']} ms")

        # A second typed turn: it goes below the first, which keeps its text; the live turn is the last one.
        pg.typed_turn("Thank you. Say goodbye.")
        turns = pg.page.locator("#chat li.turn")
        assert turns.count() == 2 and TYPED in turns.first.inner_text()
        assert pg.page.locator("#chat li.turn.live").count() == 1 and "goodbye" in turns.last.inner_text()
        pg.page.screenshot(path=str(out_dir / "typed_turn.png"), full_page=True)

        # Phone width: nothing overflows sideways.
        pg.page.set_viewport_size({"width": 375, "height": 800})
        assert pg.page.evaluate("document.documentElement.scrollWidth") <= 375
        pg.page.screenshot(path=str(out_dir / "phone.png"), full_page=True)

        # Disconnect is clean (no error shown).
        pg.tid("connect").click()
        pg.wait("!window.rtserveDemo.state.connected", 10, "disconnect")
        assert pg.tid("status").get_attribute("data-state") == "disconnected"
        assert pg.state()["error"] is None
        assert pg.errors == [], pg.errors
    finally:
        pg.close()


def test_chat_order_event_log_settings_and_tool_call(gateway, browser, out_dir):
    """The demo as a product: the served model's name in the header; turns read top to bottom with the live one last;
    every event sent and received is in the event log, filterable, its JSON a click away; a changed voice goes out in
    session.update and its session.updated shows in the log; the temperature rides on response.create; a tool call
    (tool choice required) shows in its turn with the page's result, then the reply that uses it."""
    from gateway.audio_api import VOICES

    pg = Page(browser, gateway, viewport={"width": 1280, "height": 900})
    try:
        assert sorted(pg.page.eval_on_selector_all("#voice-name option", "os => os.map(o => o.value)")) == \
            sorted(VOICES)   # the page offers the server's voice names
        pg.settings(voice=False, max_tokens=MAX_TOKENS)
        pg.connect()
        pg.wait("window.rtserveDemo.state.model !== null", 10, "the model name")
        assert pg.tid("model").inner_text() == "model: SmolLM2-135M-Instruct"
        log = pg.page.locator("#event-list li")
        pg.wait("document.querySelector('#event-list li[data-dir=server][data-type=\"session.updated\"]')", 10,
                "session.updated in the event log")
        assert log.first.get_attribute("data-type") == "session.created"   # the first event, at the top
        assert pg.page.locator("#event-list li[data-dir=client][data-type='session.update']").count() == 1

        first = pg.typed_turn(TYPED)
        second = pg.typed_turn("Thank you. Now say goodbye.")
        turns = pg.page.locator("#chat li.turn")
        assert turns.count() == 2
        boxes = [turns.nth(i).bounding_box() for i in range(2)]
        assert boxes[0]["y"] < boxes[1]["y"], boxes   # the conversation reads top to bottom
        assert TYPED in turns.nth(0).inner_text() and first in turns.nth(0).inner_text()
        assert "goodbye" in turns.nth(1).inner_text() and second in turns.nth(1).inner_text()
        assert "live" in turns.nth(1).get_attribute("class") and "live" not in turns.nth(0).get_attribute("class")
        # ...and so does the event log: each turn's item, response.create and response.done, in that order
        types = pg.page.eval_on_selector_all("#event-list li", EVENT_TYPES)
        sent = [t for t in types if t in ("client conversation.item.create", "client response.create",
                                         "server response.done")]
        assert sent == ["client conversation.item.create", "client response.create", "server response.done"] * 2, types

        # a setting changed while connected: session.update with the voice, session.updated in the log
        updated = "#event-list li[data-dir=server][data-type='session.updated']"
        before = pg.page.locator(updated).count()
        pg.toggle_settings()
        pg.tid("voice-name").select_option("echo")
        pg.tid("temperature").fill("0.3")
        pg.tid("temperature").dispatch_event("change")
        pg.toggle_settings()
        pg.wait(f"document.querySelectorAll(\"{updated}\").length > {before}", 30, "session.updated after the change")
        entry = pg.page.locator(updated).last
        entry.locator("summary").click()   # a click shows the event's JSON
        shown = json.loads(entry.get_by_test_id("event-json").inner_text())
        assert shown["session"]["audio"]["output"]["voice"] == "echo", shown
        # the filter keeps only the matching events
        pg.tid("event-filter").fill("session.updated")
        visible = pg.page.eval_on_selector_all("#event-list li:not([hidden])", "ls => ls.map(l => l.dataset.type)")
        assert visible and set(visible) == {"session.updated"}, visible
        pg.tid("event-filter").fill("")

        # a tool call: tool choice required, so the reply must call one of the demo tools
        pg.toggle_settings()
        pg.tid("tool-choice").select_option("required")
        pg.toggle_settings()
        pg.wait(f"document.querySelectorAll(\"{updated}\").length > {before + 1}", 30, "session.updated (tools)")
        before_turns = pg.state()["turns"]
        pg.tid("text-input").fill("What time is it now?")
        pg.tid("send").click()
        pg.wait(f"window.rtserveDemo.state.turns > {before_turns}", 60, "the turn to start")
        pg.wait("window.rtserveDemo.state.toolCalls > 0", 120, "the tool call")
        call = pg.page.locator("#chat li.turn.live [data-testid=tool-call]").first
        assert call.get_attribute("data-name") in ("get_time", "get_weather")
        assert "→" in call.inner_text()   # the page's result, shown under the call
        pg.wait("(s => !s.responseActive && s.assistantText.trim().length > 0)(window.rtserveDemo.state)", 120,
                "the reply that uses the tool's result")
        types = pg.page.eval_on_selector_all("#event-list li", EVENT_TYPES)
        assert "server response.function_call_arguments.done" in types
        # the page answered the call and asked for the reply: no further call, at the temperature set above
        output = pg.page.locator("#event-list li[data-dir=client][data-type='conversation.item.create']").last
        output.locator("summary").click()
        assert json.loads(output.get_by_test_id("event-json").inner_text())["item"]["type"] == "function_call_output"
        create = pg.page.locator("#event-list li[data-dir=client][data-type='response.create']").last
        create.locator("summary").click()
        assert json.loads(create.get_by_test_id("event-json").inner_text())["response"] == \
            {"tool_choice": "none", "temperature": 0.3}
        s = pg.state()
        assert s["error"] is None, s["error"]
        pg.page.screenshot(path=str(out_dir / "product.png"), full_page=False)
        pg.page.set_viewport_size({"width": 375, "height": 800})   # phone width: one column, nothing sideways
        assert pg.page.evaluate("document.documentElement.scrollWidth") <= 375
        pg.page.screenshot(path=str(out_dir / "product_phone.png"), full_page=True)
        assert pg.errors == [], pg.errors
    finally:
        pg.close()


def test_voice_turn_barge_in_and_typed_turn(gateway, browser, speech_wav, out_dir):
    """Spoken words from the fake mic: the user's transcript appears, the reply text streams, its audio starts playing.
    Talking over the reply stops playback and sends conversation.item.truncate; then a typed turn also gets a reply."""
    wav, wav_s = speech_wav
    pg = Page(browser, gateway, viewport={"width": 1000, "height": 900})
    try:
        # A long reply, so that there is still audio playing when we talk over it.
        pg.settings(instructions=STORYTELLER, max_tokens=STORY_TOKENS)
        pg.connect()
        assert pg.state()["error"] is None
        pg.tid("mic").click()  # server VAD is on by default; the fake mic starts playing the wav now
        pg.wait("window.rtserveDemo.state.micOn", 60, "the microphone to start")

        pg.wait("window.rtserveDemo.state.userTranscript.trim().length > 0", 90, "the user's transcript")
        pg.wait("window.rtserveDemo.state.userTranscriptFinal", 60, "the complete transcript")
        pg.wait("window.rtserveDemo.state.assistantText.trim().length > 0", 90, "the reply text")
        pg.wait("window.rtserveDemo.state.playbackStarted", 90, "reply audio playback")
        s = pg.state()
        heard = s["userTranscript"].lower()
        assert any(k in heard for k in SPOKEN_KEYWORDS), f"transcript {heard!r} has none of {SPOKEN_KEYWORDS}"
        assert pg.tid("user-transcript").inner_text().strip() == s["userTranscript"].strip()
        assert s["lastLatency"]["audioMs"] is not None and s["lastLatency"]["audioMs"] > 0
        pg.wait("window.rtserveDemo.state.playedMs > 300", 30, "reply audio to keep playing")
        print(f"voice turn: heard {s['userTranscript']!r}; latency {s['lastLatency']}")
        pg.page.screenshot(path=str(out_dir / "voice_turn.png"), full_page=True)

        # Barge-in: Chromium's fake mic replays its file when capture restarts (once the first play has ended).
        pg.wait(f"window.rtserveDemo.state.audioSentMs >= {int(wav_s * 1000) + 300}", 60, "the first play to end")
        s = pg.state()
        assert s["playing"] or s["responseActive"], \
            f"the reply ended before we could talk over it (played {s['playedMs']} ms): {s}"
        pg.page.evaluate("window.rtserveDemo.stopMic()")
        pg.page.evaluate("window.rtserveDemo.startMic()")
        pg.wait("window.rtserveDemo.state.truncations > 0", 30, "barge-in (conversation.item.truncate)")
        s = pg.state()
        assert not s["playing"], "playback must stop at once on barge-in"
        assert s["playedMs"] > 300
        assert pg.tid("playback").inner_text().startswith("interrupted at")
        # The interrupted turn, marked as interrupted, is no longer the live one; the new utterance is transcribed too.
        pg.wait("window.rtserveDemo.state.truncationsAcked > 0", 60, "conversation.item.truncated from the server")
        pg.wait("window.rtserveDemo.state.userTranscript.trim().length > 0", 90, "the second transcript")
        assert pg.page.locator("#chat li.turn:not(.live) .text[data-state=interrupted]").count() >= 1
        pg.wait("window.rtserveDemo.state.assistantText.trim().length > 0", 90, "the reply to the second utterance")

        # Typed turn on the same session while that (long) reply still runs: the page cancels it, waits for its
        # response.done, then asks for the new reply (voice on: the reply text is the audio transcript).
        pg.page.evaluate("window.rtserveDemo.stopMic()")
        reply = pg.typed_turn(TYPED)
        print(f"typed reply: {reply!r}")
        s = pg.state()
        assert s["error"] is None, s["error"]
        pg.wait("window.rtserveDemo.state.playedMs > 500", 30, "the typed turn's spoken reply to play")
        pg.page.screenshot(path=str(out_dir / "web_demo.png"), full_page=False)
        assert pg.errors == [], pg.errors
    finally:
        pg.close()


def test_push_to_talk(gateway, browser, speech_wav, out_dir):
    """Server VAD off (turn_detection null): tap the mic to talk, tap again to send; the page commits the buffer and
    asks for the reply itself."""
    wav, wav_s = speech_wav
    pg = Page(browser, gateway, viewport={"width": 1000, "height": 900})
    try:
        pg.settings(vad=False, max_tokens=MAX_TOKENS)
        pg.connect()
        assert "tap to talk" in pg.tid("mic").inner_text()
        pg.tid("mic").click()  # tap: starts the mic (the fake mic plays the wav from its start) and the turn
        pg.wait("window.rtserveDemo.state.talking", 60, "push-to-talk to start")
        # Talk for the whole file (words and trailing silence): wait until the page has streamed all of it.
        pg.wait(f"window.rtserveDemo.state.audioSentMs >= {int(wav_s * 1000) - 100}", 30, "the mic audio to be sent")
        s = pg.state()
        assert s["talking"] and not s["speaking"], s  # no server VAD events: the page decides the turn
        pg.tid("mic").click()  # tap again: commit + response.create
        pg.wait("!window.rtserveDemo.state.talking", 60, "push-to-talk to stop")
        pg.wait("window.rtserveDemo.state.userTranscript.trim().length > 0", 90, "the user's transcript")
        pg.wait("window.rtserveDemo.state.userTranscriptFinal", 60, "the complete transcript")
        heard = pg.state()["userTranscript"].lower()
        assert any(k in heard for k in SPOKEN_KEYWORDS), f"transcript {heard!r} has none of {SPOKEN_KEYWORDS}"
        pg.wait("window.rtserveDemo.state.assistantText.trim().length > 0", 90, "the reply text")
        pg.wait("window.rtserveDemo.state.playbackStarted", 90, "reply audio playback")
        s = pg.state()
        assert s["error"] is None, s["error"]
        assert s["lastLatencyMs"] is not None and s["lastLatencyMs"] > 0
        pg.page.screenshot(path=str(out_dir / "push_to_talk.png"), full_page=True)
        assert pg.errors == [], pg.errors
    finally:
        pg.close()


def test_served_websockets_do_not_compress_by_default(gateway):
    """`rtserve serve` declines permessage-deflate unless `--ws-compression` (base64 audio barely compresses, and the
    deflate CPU lands on the event loop); a client that offers it still gets its session."""
    from websockets.sync.client import connect

    with connect(gateway.replace("http", "ws") + "/v1/realtime", compression="deflate") as ws:
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"


def test_api_key_and_connection_errors(browser, out_dir):
    """With a server API key: connecting without it fails with a clear message; with the key entered in Settings the
    page offers `openai-insecure-api-key.KEY` and connects. A server that goes away is reported as a disconnect."""
    key = "sk-web-demo-test"
    with run_gateway(out_dir, "--api-key", key, log_name="gateway_api_key.log") as base:
        pg = Page(browser, base, viewport={"width": 1000, "height": 900})
        pg.tid("connect").click()
        pg.wait("window.rtserveDemo.state.error !== null", 15, "the refused connection to be reported")
        s = pg.state()
        assert not s["connected"] and "API key" in s["error"], s
        assert pg.tid("status").get_attribute("data-state") == "error"
        assert pg.tid("error").is_visible()

        pg.toggle_settings()
        pg.tid("api-key").fill(key)
        pg.toggle_settings()
        pg.settings(max_tokens=MAX_TOKENS)
        pg.connect()
        assert pg.state()["error"] is None
        assert not pg.tid("error").is_visible()
        assert pg.typed_turn(TYPED)
    # The gateway has stopped: the open page must say so.
    try:
        pg.wait("window.rtserveDemo.state.connection === 'error'", 30, "the disconnect to be reported")
        s = pg.state()
        assert not s["connected"] and s["error"] and "Disconnected" in s["error"], s
        assert pg.tid("status").inner_text().strip() == "Disconnected"
        assert pg.errors == [], pg.errors
    finally:
        pg.close()
