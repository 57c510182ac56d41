// rtserve web demo: OpenAI Realtime (GA dialect) over a WebSocket, mic through an AudioWorklet, reply audio through Web
// Audio with a small jitter buffer, barge-in with conversation.item.truncate. The conversation reads top to bottom with
// the live turn last; tool calls (two demo tools run in the page) show inside their turn; the event log lists every
// event sent and received. Plain ES module, no build step.
//
// Scripting hooks: every control and live region has a data-testid; window.rtserveDemo.state is a frozen snapshot
// (connected, playbackStarted, lastLatencyMs, error, model, toolCalls, ...);
// window.rtserveDemo.{connect,disconnect,sendText,startMic,stopMic}.

const RATE = 24000;
const JITTER_LEAD_S = 0.15;   // delay before the first chunk of a reply plays (absorbs network/TTS jitter)
const UNDERRUN_LEAD_S = 0.08; // delay used when the buffer ran dry mid-reply
const TRANSCRIPTION_MODEL = 'whisper-1'; // the server maps it to its own Whisper
const HOLD_MS = 350;          // push-to-talk: a press longer than this is "hold to talk", shorter is "tap to toggle"
const EVENT_LOG_MAX = 500;    // entries kept in the event log (audio chunks arrive 25 a second each way)
// The voice names the server accepts (gateway/audio_api.py VOICES; tests/web_demo keeps the two lists equal). They all
// speak with the one piper voice it ships.
const VOICES = ['alloy', 'ash', 'ballad', 'coral', 'echo', 'fable', 'onyx', 'nova', 'sage', 'shimmer', 'verse', 'marin',
                'cedar', 'joe'];
// Demo tools, run in the page: the model asks, the page answers with a function_call_output and asks for the reply.
const TOOLS = {
  get_time: {
    description: "The user's current local date and time.",
    parameters: { type: 'object', properties: {}, additionalProperties: false },
    run: () => ({ time: new Date().toString(), timezone: Intl.DateTimeFormat().resolvedOptions().timeZone }),
  },
  get_weather: {
    description: 'The current weather in a city.',
    parameters: { type: 'object', required: ['city'], additionalProperties: false,
                  properties: { city: { type: 'string', maxLength: 40 } } },
    // a canned answer: the demo has no network access to a weather service
    run: (args) => ({ city: args.city, forecast: 'sunny', temperature_c: 21 }),
  },
};

const $ = (id) => document.getElementById(id);
const ui = {
  status: $('status'),
  connect: $('connect'), mic: $('mic'), micLabel: $('mic-label'), micLevel: $('mic-level'), micHint: $('mic-hint'),
  textForm: $('text-form'), textInput: $('text-input'), send: $('send'),
  chat: $('chat'), model: $('model'),
  vad: $('vad-indicator'), playback: $('playback'), latency: $('latency'),
  error: $('error'), errorText: $('error-text'), errorClose: $('error-close'),
  url: $('server-url'), key: $('api-key'), instructions: $('instructions'),
  voice: $('voice'), vadToggle: $('vad'), silence: $('silence'), maxTokens: $('max-tokens'),
  voiceName: $('voice-name'), temperature: $('temperature'), tools: $('tools'), toolChoice: $('tool-choice'),
  events: $('events'), eventList: $('event-list'), eventFilter: $('event-filter'), eventAudio: $('event-audio'),
  eventClear: $('event-clear'), eventCount: $('event-count'),
};

// ---------------------------------------------------------------------------------------------------------------- state
const state = {
  connected: false,        // socket open and session.created received
  connection: 'disconnected', // disconnected | connecting | connected | error
  sessionId: null,
  subprotocol: null,       // what the server echoed ("realtime")
  micOn: false,            // capturing from the microphone
  talking: false,          // push-to-talk: currently sending audio
  speaking: false,         // server VAD says the user is speaking
  responseActive: false,
  cancelling: false,       // response.cancel sent, waiting for its response.done
  playbackStarted: false,  // the current/last reply's audio has actually started playing
  playing: false,          // reply audio is playing right now
  playedMs: 0,             // ms of the current/last reply's audio played so far
  lastLatencyMs: null,     // end of speech (or Send) -> first reply output, ms
  lastLatency: { textMs: null, audioMs: null }, // -> first reply text, -> first reply audio (actually playing)
  userTranscript: '',
  userTranscriptFinal: false, // the current turn's transcript is complete (typed, or transcription .completed)
  assistantText: '',
  turns: 0,
  truncations: 0,          // conversation.item.truncate events sent (barge-ins)
  truncationsAcked: 0,     // conversation.item.truncated events received
  audioSentMs: 0,          // mic audio appended to the server's input buffer in this session
  eventsReceived: 0,
  eventsLogged: 0,         // events sent and received, all counted (the log keeps the last EVENT_LOG_MAX)
  lastEvent: null,
  error: null,             // last error message shown, or null
  model: null,             // the model serving the session (session.created), or /v1/models' first before that
  toolCalls: 0,            // tool calls the page ran
};

function snapshot() {
  return Object.freeze({ ...state, lastLatency: Object.freeze({ ...state.lastLatency }) });
}

// ------------------------------------------------------------------------------------------------------------- settings
const params = new URLSearchParams(location.search);
function defaultUrl() {
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${proto}//${location.host || '127.0.0.1:8000'}/v1/realtime`;
}
function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem('rtserve-demo') || '{}'); } catch (_) { saved = {}; }
  ui.url.value = params.get('url') || saved.url || defaultUrl();
  if (params.has('instructions')) ui.instructions.value = params.get('instructions');
  else if (typeof saved.instructions === 'string') ui.instructions.value = saved.instructions;
  const flag = (name, fallback) => (params.has(name) ? !/^(0|false|off|no)$/i.test(params.get(name)) : fallback);
  ui.voice.checked = flag('voice', saved.voice ?? true);
  ui.vadToggle.checked = flag('vad', saved.vad ?? true);
  ui.silence.value = params.get('silence') || saved.silence || 500;
  ui.maxTokens.value = params.get('max_tokens') || saved.maxTokens || '';
  for (const v of VOICES) ui.voiceName.append(new Option(v, v));
  ui.voiceName.value = VOICES.includes(params.get('voice_name') || saved.voiceName) ? (params.get('voice_name') || saved.voiceName) : VOICES[0];
  ui.temperature.value = params.get('temperature') || saved.temperature || '';
  ui.tools.checked = flag('tools', saved.tools ?? true);
  ui.toolChoice.value = ['auto', 'required', 'none'].includes(saved.toolChoice) ? saved.toolChoice : 'auto';
}
function saveSettings() {
  try {
    localStorage.setItem('rtserve-demo', JSON.stringify({
      url: ui.url.value === defaultUrl() ? undefined : ui.url.value,
      instructions: ui.instructions.value, voice: ui.voice.checked, vad: ui.vadToggle.checked,
      silence: Number(ui.silence.value), maxTokens: ui.maxTokens.value, voiceName: ui.voiceName.value,
      temperature: ui.temperature.value, tools: ui.tools.checked, toolChoice: ui.toolChoice.value,
    }));
  } catch (_) { /* private mode */ }
}
const vadOn = () => ui.vadToggle.checked;
function silenceMs() {
  const v = Math.round(Number(ui.silence.value));
  return Number.isFinite(v) ? Math.min(3000, Math.max(100, v)) : 500;
}

function maxTokens() {
  const v = Math.round(Number(ui.maxTokens.value));
  return ui.maxTokens.value.trim() && Number.isFinite(v) && v > 0 ? Math.min(4096, v) : 'inf';
}

// The GA session has no temperature: the page sends it with each response.create it sends (typed turns,
// push-to-talk, tool answers); replies that server VAD starts use the model's default.
function temperature() {
  const v = Number(ui.temperature.value);
  return ui.temperature.value.trim() && Number.isFinite(v) ? Math.min(2, Math.max(0, v)) : null;
}

function toolsConfig() {
  if (!ui.tools.checked) return { tools: [], tool_choice: 'auto' };
  return {
    tools: Object.entries(TOOLS).map(([name, t]) => ({ type: 'function', name, description: t.description, parameters: t.parameters })),
    tool_choice: ui.toolChoice.value,
  };
}

function sessionConfig() {
  return {
    type: 'realtime',
    output_modalities: ui.voice.checked ? ['audio'] : ['text'],
    instructions: ui.instructions.value,
    max_output_tokens: maxTokens(),
    ...toolsConfig(),
    audio: {
      input: {
        format: { type: 'audio/pcm', rate: RATE },
        transcription: { model: TRANSCRIPTION_MODEL }, // ask for the user's transcript (as OpenAI's service needs)
        turn_detection: vadOn()
          ? { type: 'server_vad', silence_duration_ms: silenceMs(), create_response: true, interrupt_response: true }
          : null,
      },
      output: { format: { type: 'audio/pcm', rate: RATE }, voice: ui.voiceName.value },
    },
  };
}

// ------------------------------------------------------------------------------------------------------------------- UI
function setConnection(s, text) {
  state.connection = s;
  ui.status.dataset.state = s;
  ui.status.textContent = text || { disconnected: 'Disconnected', connecting: 'Connecting…', connected: 'Connected', error: 'Error' }[s];
  ui.connect.textContent = s === 'disconnected' || s === 'error' ? 'Connect' : 'Disconnect';
  ui.connect.classList.toggle('primary', s === 'disconnected' || s === 'error');
  const live = s === 'connected';
  ui.mic.disabled = !live;
  ui.textInput.disabled = !live;
  ui.send.disabled = !live;
}

function showError(msg) {
  state.error = msg;
  ui.errorText.textContent = msg;
  ui.error.hidden = false;
}
function clearError() {
  state.error = null;
  ui.error.hidden = true;
}

function setPill(el, s, text) { el.dataset.state = s; el.textContent = text; }

function micUi() {
  const ptt = !vadOn();
  ui.mic.classList.toggle('on', state.micOn && (!ptt || state.talking));
  ui.mic.setAttribute('aria-pressed', String(ptt ? state.talking : state.micOn));
  if (ptt) ui.micLabel.textContent = state.talking ? 'Release / tap to send' : 'Hold or tap to talk';
  else ui.micLabel.textContent = state.micOn ? 'Stop mic' : 'Start mic';
  ui.micHint.textContent = ptt
    ? 'Push-to-talk: hold the mic button while you talk (or tap to start, tap again to send).'
    : 'Server VAD is on: talk, pause, and the reply starts. Talk over a reply to interrupt it.';
  if (!state.micOn) ui.micLevel.style.width = '0';
}

function fmtMs(v) { return v == null ? '–' : `${Math.round(v)} ms`; }
function showLatency() {
  const l = state.lastLatency;
  ui.latency.textContent = `latency: text ${fmtMs(l.textMs)} · audio ${fmtMs(l.audioMs)}`;
}

// --------------------------------------------------------------------------------------------------------------- turns
// The conversation is a list of turns, oldest first; the live turn is the last one and carries the user-transcript and
// assistant-text test ids. A turn: the user's line, the tool calls its replies made, the assistant's line.
let cur = null;
const turnByUserItem = new Map();
const turnByResponse = new Map();

function newTurn(kind, count = true) {
  if (cur && !cur.user && !cur.assistant && cur.calls.length === 0) cur.el.remove(); // a turn that never had content
  else if (cur) setLive(cur, false);
  const li = document.createElement('li');
  li.className = 'turn live';
  li.innerHTML = '<div class="line user"><div class="who">You</div><div class="text"></div></div>' +
                 '<div class="calls"></div>' +
                 '<div class="line assistant"><div class="who">Assistant</div><div class="text"></div></div>';
  const [userEl, assistantEl] = li.querySelectorAll('.text');
  userEl.dataset.placeholder = 'Click the mic and talk, or type below.';
  assistantEl.dataset.placeholder = 'The reply streams here.';
  cur = {
    user: '', userFinal: false, assistant: '', listening: kind === 'listening', interrupted: false, noSpeech: false,
    anchor: null, firstText: null, firstAudio: null, responseId: null, userItem: null,
    el: li, userEl, assistantEl, callsEl: li.querySelector('.calls'), calls: [], awaitingToolAnswer: false,
  };
  setLive(cur, true);
  ui.chat.append(li);
  if (count) state.turns += 1;
  render(cur);
  return cur;
}

function setLive(t, live) {
  t.el.classList.toggle('live', live);
  if (live) {
    t.userEl.id = 'user-transcript'; t.userEl.dataset.testid = 'user-transcript';
    t.assistantEl.id = 'assistant-text'; t.assistantEl.dataset.testid = 'assistant-text';
  } else {
    for (const el of [t.userEl, t.assistantEl]) { el.removeAttribute('id'); delete el.dataset.testid; }
    t.listening = false;
    render(t);
  }
}

// Keep the newest line in view, unless the user scrolled up to read.
function scrollChat(wasAtEnd) {
  if (wasAtEnd) ui.chat.scrollTop = ui.chat.scrollHeight;
}
function chatAtEnd() { return ui.chat.scrollHeight - ui.chat.scrollTop - ui.chat.clientHeight < 40; }

function render(t) {
  if (!t) return;
  const atEnd = chatAtEnd();
  const u = t.userEl, a = t.assistantEl;
  u.textContent = t.user;
  u.dataset.state = t.listening && !t.user ? 'listening' : t.noSpeech && !t.user ? 'nospeech' : t.user ? 'done' : 'empty';
  a.textContent = t.assistant;
  a.dataset.state = t.interrupted ? 'interrupted' : t.assistant ? 'text' : 'empty';
  if (t === cur) {
    state.userTranscript = t.user;
    state.userTranscriptFinal = t.userFinal;
    state.assistantText = t.assistant;
  }
  scrollChat(atEnd);
}

// ---------------------------------------------------------------------------------------------------------- tool calls
// A call shows in its turn as name(arguments) → result. Once the response that made the calls is done, the page sends
// each result as a function_call_output item and asks for the reply that uses them (tool_choice none: an answer, not
// another call).
function showToolCall(t, call) {
  const atEnd = chatAtEnd();
  const div = document.createElement('div');
  div.className = 'tool-call';
  div.dataset.testid = 'tool-call';
  div.dataset.name = call.name;
  div.innerHTML = '<span class="tag">tool call</span> <code class="call"></code><div class="result"></div>';
  div.querySelector('.call').textContent = `${call.name}(${call.arguments})`;
  div.querySelector('.result').textContent = `→ ${JSON.stringify(call.output)}`;
  t.callsEl.append(div);
  scrollChat(atEnd);
}

function runToolCall(m) {
  const tool = TOOLS[m.name];
  let output;
  try {
    const args = m.arguments ? JSON.parse(m.arguments) : {};
    output = tool ? tool.run(args) : { error: `unknown tool ${m.name}` };
  } catch (e) {
    output = { error: `bad arguments: ${e.message}` };
  }
  const t = turnForResponse(m.response_id);
  const call = { name: m.name, arguments: m.arguments || '{}', callId: m.call_id, responseId: m.response_id, output };
  if (t) { t.calls.push(call); showToolCall(t, call); }
  state.toolCalls += 1;
  return call;
}

function answerToolCalls(t, responseId) {
  const calls = t ? t.calls.filter((c) => c.responseId === responseId && !c.answered) : [];
  if (calls.length === 0) return;
  for (const c of calls) {
    c.answered = true;
    send({ type: 'conversation.item.create',
           item: { type: 'function_call_output', call_id: c.callId, output: JSON.stringify(c.output) } });
  }
  t.awaitingToolAnswer = true;
  requestResponse({ tool_choice: 'none' });
}

function markFirstText(t) {
  if (!t || t.firstText != null || t.anchor == null) return;
  t.firstText = performance.now();
  if (t === cur) {
    state.lastLatency = { textMs: t.firstText - t.anchor, audioMs: null };
    state.lastLatencyMs = Math.round(t.firstText - t.anchor);
    showLatency();
  }
}
function markFirstAudio(t, wallTime) {
  if (!t || t.firstAudio != null || t.anchor == null) return;
  t.firstAudio = wallTime;
  if (t === cur) {
    state.lastLatency = { ...state.lastLatency, audioMs: t.firstAudio - t.anchor };
    if (state.lastLatencyMs == null || t.firstText == null) state.lastLatencyMs = Math.round(t.firstAudio - t.anchor);
    showLatency();
  }
}

// ---------------------------------------------------------------------------------------------------------- event log
// Every event sent (↑) and received (↓), newest last; a click on one shows its JSON (audio payloads shortened). Audio
// chunks are hidden unless asked for; the filter matches event types.
const AUDIO_CHUNKS = new Set(['input_audio_buffer.append', 'response.output_audio.delta', 'response.audio.delta']);
const eventJson = new WeakMap(); // li -> the event, rendered to JSON only when opened

function shortened(ev) {
  if (typeof ev.audio === 'string' && ev.audio.length > 64) return { ...ev, audio: `<${ev.audio.length} base64 chars>` };
  if (AUDIO_CHUNKS.has(ev.type) && typeof ev.delta === 'string') return { ...ev, delta: `<${ev.delta.length} base64 chars>` };
  return ev;
}

function eventVisible(li) {
  const f = ui.eventFilter.value.trim().toLowerCase();
  if (li.dataset.audio && !ui.eventAudio.checked) return false;
  return !f || li.dataset.type.toLowerCase().includes(f);
}

function logEvent(dir, ev) {
  state.eventsLogged += 1;
  ui.eventCount.textContent = String(state.eventsLogged);
  const atEnd = ui.eventList.scrollHeight - ui.eventList.scrollTop - ui.eventList.clientHeight < 40;
  const li = document.createElement('li');
  li.dataset.dir = dir;
  li.dataset.type = ev.type || '?';
  li.dataset.testid = 'event';
  if (AUDIO_CHUNKS.has(ev.type)) li.dataset.audio = '1';
  if (ev.type === 'error' || (ev.type === 'response.done' && ev.response && ev.response.status === 'failed')) li.dataset.error = '1';
  const d = document.createElement('details');
  const summary = document.createElement('summary');
  const t = new Date();
  summary.innerHTML = '<span class="dir"></span><span class="type"></span><span class="time"></span>';
  summary.querySelector('.dir').textContent = dir === 'client' ? '↑' : '↓';
  summary.querySelector('.type').textContent = li.dataset.type;
  summary.querySelector('.time').textContent = t.toTimeString().slice(0, 8) + '.' + String(t.getMilliseconds()).padStart(3, '0');
  d.append(summary);
  d.addEventListener('toggle', () => {
    if (d.open && !d.querySelector('pre')) {
      const pre = document.createElement('pre');
      pre.dataset.testid = 'event-json';
      pre.textContent = JSON.stringify(shortened(eventJson.get(li)), null, 2);
      d.append(pre);
    }
  });
  li.append(d);
  eventJson.set(li, ev);
  li.hidden = !eventVisible(li);
  ui.eventList.append(li);
  while (ui.eventList.childElementCount > EVENT_LOG_MAX) ui.eventList.firstElementChild.remove();
  if (atEnd) ui.eventList.scrollTop = ui.eventList.scrollHeight;
}

function filterEvents() {
  for (const li of ui.eventList.children) li.hidden = !eventVisible(li);
}

// ---------------------------------------------------------------------------------------------------------------- model
function showModel(name) {
  if (!name) return;
  state.model = name;
  ui.model.textContent = `model: ${name}`;
}

// Before a session: the page's own server names its model (a server that wants a key answers 401: wait for the session).
async function fetchModel() {
  try {
    const r = await fetch('/v1/models', { headers: { Accept: 'application/json' } });
    if (!r.ok) return;
    const body = await r.json();
    if (!state.model && body.data && body.data[0]) showModel(body.data[0].id);
  } catch (_) { /* a page opened from a file, or another server: the session says it */ }
}

// ---------------------------------------------------------------------------------------------------------- websocket
let ws = null;
let userClosed = false;
let opened = false;

function send(obj) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return false;
  ws.send(JSON.stringify(obj));
  logEvent('client', obj);
  return true;
}

function connect() {
  if (ws) return;
  clearError();
  saveSettings();
  ensureAudio(); // inside the click: browsers only allow audio output after a user gesture
  const url = ui.url.value.trim() || defaultUrl();
  const protocols = ['realtime'];
  const key = ui.key.value.trim();
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  let sock;
  try {
    sock = new WebSocket(url, protocols);
  } catch (e) {
    setConnection('error');
    showError(`Bad server address "${url}": ${e.message}`);
    return;
  }
  ws = sock;
  samplesSent = 0;
  state.audioSentMs = 0;
  sentMarks.length = 0;
  pendingCreate = false;
  state.cancelling = false;
  userClosed = false;
  opened = false;
  setConnection('connecting');
  sock.onopen = () => { opened = true; state.subprotocol = sock.protocol; };
  sock.onmessage = (ev) => {
    if (sock !== ws) return;
    let msg;
    try { msg = JSON.parse(ev.data); } catch (_) { return; }
    state.eventsReceived += 1;
    state.lastEvent = msg.type;
    logEvent('server', msg);
    try { onEvent(msg); } catch (e) { console.error('rtserve demo: event handler failed', msg.type, e); }
  };
  sock.onerror = () => { /* the close event that follows carries the details */ };
  sock.onclose = (ev) => {
    if (sock !== ws) return;
    ws = null;
    const wasConnected = state.connected;
    state.connected = false;
    state.responseActive = false;
    stopMic();
    stopPlayback();
    if (userClosed) { setConnection('disconnected'); return; }
    setConnection('error', wasConnected ? 'Disconnected' : 'Connection failed');
    const why = ev.reason ? ` (${ev.reason})` : '';
    if (!opened) {
      showError(`Could not connect to ${url}: is rtserve running there? (close code ${ev.code}${why}; a wrong or missing API key also ends here)`);
    } else if (!wasConnected) {
      showError(`The server closed the connection before the session started (code ${ev.code}${why}).`);
    } else {
      showError(`Disconnected from the server (code ${ev.code}${why}). Click Connect to start a new session.`);
    }
  };
}

function disconnect() {
  if (!ws) return;
  userClosed = true;
  const s = ws;
  ws = null;
  state.connected = false;
  state.responseActive = false;
  stopMic();
  stopPlayback();
  try { s.close(1000, 'bye'); } catch (_) { /* already closing */ }
  setConnection('disconnected');
}

function updateSession() {
  saveSettings();
  micUi();
  if (state.connected) send({ type: 'session.update', session: sessionConfig() });
}

// ---------------------------------------------------------------------------------------------------------- events
const interrupted = new Set(); // response ids whose audio/text we stopped on barge-in
const HARMLESS = new Set(['response_cancel_not_active']);

function turnForResponse(id) { return turnByResponse.get(id) || cur; }

function onEvent(m) {
  switch (m.type) {
    case 'session.created':
      state.connected = true;
      state.sessionId = (m.session && m.session.id) || null;
      showModel(m.session && m.session.model);
      setConnection('connected');
      send({ type: 'session.update', session: sessionConfig() });
      break;
    case 'session.updated':
      break;

    case 'input_audio_buffer.speech_started': {
      state.speaking = true;
      setPill(ui.vad, 'speaking', 'speaking');
      bargeIn();
      const t = newTurn('listening');
      t.userItem = m.item_id || null;
      if (t.userItem) turnByUserItem.set(t.userItem, t);
      break;
    }
    case 'input_audio_buffer.speech_stopped': {
      state.speaking = false;
      setPill(ui.vad, 'thinking', 'thinking');
      const t = (m.item_id && turnByUserItem.get(m.item_id)) || cur;
      if (t && t.anchor == null) t.anchor = speechEndWallTime(m.audio_end_ms);
      break;
    }
    case 'input_audio_buffer.committed': {
      const t = cur;
      if (t && m.item_id) {
        if (!t.userItem) t.userItem = m.item_id;
        turnByUserItem.set(m.item_id, t);
      }
      break;
    }
    case 'input_audio_buffer.cleared':
      break;

    case 'conversation.item.input_audio_transcription.delta': {
      const t = turnByUserItem.get(m.item_id) || cur;
      if (!t) break;
      t.user += m.delta || '';
      render(t);
      break;
    }
    case 'conversation.item.input_audio_transcription.completed': {
      const t = turnByUserItem.get(m.item_id) || cur;
      if (!t) break;
      t.user = (m.transcript || '').trim();
      t.userFinal = true;
      t.listening = false;
      if (!t.user) t.noSpeech = true;
      render(t);
      break;
    }
    case 'conversation.item.input_audio_transcription.failed': {
      const t = turnByUserItem.get(m.item_id) || cur;
      if (t) { t.listening = false; t.noSpeech = true; render(t); }
      showError(`Transcription failed: ${(m.error && m.error.message) || 'unknown error'}`);
      break;
    }

    case 'response.created': {
      const id = m.response && m.response.id;
      state.responseActive = true;
      state.playbackStarted = false;
      state.playedMs = 0;
      let t = cur;
      if (t && t.awaitingToolAnswer) t.awaitingToolAnswer = false; // the answer to its tool calls: the same turn
      else if (!t || (t.responseId && t.responseId !== id) || t.assistant) t = newTurn('response');
      t.responseId = id;
      if (t.anchor == null) t.anchor = performance.now();
      if (id) turnByResponse.set(id, t);
      setPill(ui.vad, 'replying', 'replying');
      break;
    }
    case 'response.output_text.delta':
    case 'response.text.delta':
    case 'response.output_audio_transcript.delta':
    case 'response.audio_transcript.delta': {
      if (interrupted.has(m.response_id)) break;
      const t = turnForResponse(m.response_id);
      if (!t) break;
      t.assistant += m.delta || '';
      markFirstText(t);
      render(t);
      break;
    }
    case 'response.output_audio.delta':
    case 'response.audio.delta': {
      if (interrupted.has(m.response_id) || !m.delta) break;
      const t = turnForResponse(m.response_id);
      const startWall = playChunk(m.item_id, m.response_id, m.delta);
      if (startWall != null) markFirstAudio(t, startWall);
      break;
    }
    case 'response.function_call_arguments.done':
      if (!interrupted.has(m.response_id)) runToolCall(m);
      break;
    case 'response.done': {
      const r = m.response || {};
      state.responseActive = false;
      state.cancelling = false;
      const t = turnForResponse(r.id);
      if (pendingCreate) { send(responseCreate(pendingCreate)); pendingCreate = false; }
      // a reply cut at its token cap still made its closed calls: answer them too
      else if (r.status === 'completed' || r.status === 'incomplete') answerToolCalls(t, r.id);
      if (t && r.status === 'cancelled') { t.interrupted = true; render(t); }
      if (r.status === 'failed') {
        const d = r.status_details && (r.status_details.error || r.status_details);
        showError(`The reply failed: ${(d && (d.message || d.reason || d.type)) || 'server error'}`);
      }
      if (!state.speaking) setPill(ui.vad, 'idle', state.micOn ? 'listening' : 'mic off');
      break;
    }
    case 'conversation.item.truncated':
      state.truncationsAcked += 1;
      break;

    case 'error': {
      const e = m.error || {};
      if (HARMLESS.has(e.code)) break;
      if (e.code === 'audio_unavailable') { // a text-only server: stop streaming the mic instead of repeating the error
        if (state.micOn) stopMic();
        showError('This server runs without the audio stage, so the microphone is off: type your message instead.');
        break;
      }
      showError(`Server error${e.code ? ` (${e.code})` : ''}${e.param ? ` in ${e.param}` : ''}: ${e.message || 'unknown error'}`);
      break;
    }
    default:
      break;
  }
}

// The user's speech ended at audio_end_ms of the input stream; map it back to the wall-clock time we sent that sample,
// so the latency readout covers the VAD silence wait too (what the user actually waits). Falls back to "now".
const sentMarks = []; // [cumulative samples sent, performance.now()] for recent frames
let samplesSent = 0;
function speechEndWallTime(audioEndMs) {
  const now = performance.now();
  if (typeof audioEndMs !== 'number' || sentMarks.length === 0) return now;
  const target = (audioEndMs / 1000) * RATE;
  for (let i = sentMarks.length - 1; i >= 0; i--) {
    const [n, t] = sentMarks[i];
    if (n <= target) {
      const wall = t + ((target - n) / RATE) * 1000;
      // Sanity: speech cannot end in the future or much earlier than the VAD silence window allows.
      return wall <= now && wall >= now - silenceMs() - 3000 ? wall : now;
    }
  }
  return now;
}

// ------------------------------------------------------------------------------------------------------------ audio
let ctx = null;         // playback (and, in Chromium, capture) context at 24 kHz
let outGain = null;

function ensureAudio() {
  if (!ctx) {
    const AC = window.AudioContext || window.webkitAudioContext;
    try {
      ctx = new AC({ sampleRate: RATE, latencyHint: 'interactive' });
    } catch (_) {
      ctx = new AC({ latencyHint: 'interactive' }); // buffers at 24 kHz are resampled on playback
    }
    outGain = ctx.createGain();
    outGain.connect(ctx.destination);
  }
  if (ctx.state === 'suspended') ctx.resume().catch(() => {});
  watchAudio(ctx);
  return ctx;
}

// A context that is still not running a few seconds after a click means no usable audio device (or a browser that
// wants another click): say so once, instead of a silent mic and silent replies. Text turns keep working.
const watched = new WeakSet();
function watchAudio(c) {
  if (watched.has(c)) return;
  watched.add(c);
  setTimeout(() => {
    if (c.state === 'running' || c.state === 'closed') return;
    showError('The browser\'s audio engine has not started (no audio device, or it is waiting for a click on the page): ' +
              'the microphone and spoken replies need it; typed turns still work.');
    document.addEventListener('click', () => c.resume().catch(() => {}), { once: true });
  }, 3000);
}

// Playback: each delta becomes an AudioBufferSourceNode scheduled right after the previous one. The first chunk of a reply
// (and the chunk after an underrun) starts a little in the future: that lead is the jitter buffer.
const player = { itemId: null, responseId: null, segments: [], sources: new Set(), end: 0, timer: null, cutMs: null };

function decodePcm16(b64) {
  const s = atob(b64);
  const n = s.length >> 1;
  const f = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let v = s.charCodeAt(2 * i) | (s.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    f[i] = v / 32768;
  }
  return f;
}

function playChunk(itemId, responseId, b64) {
  const c = ensureAudio();
  const f = decodePcm16(b64);
  if (f.length === 0) return null;
  if (player.itemId !== itemId || player.responseId !== responseId) {
    // A new audio item: play it after whatever is still queued (or right away with the jitter lead).
    player.itemId = itemId;
    player.responseId = responseId;
    player.cutMs = null;
    player.segments = player.segments.filter((s) => s.start + s.dur > c.currentTime);
    player.segments.forEach((s) => { s.old = true; });
  }
  const now = c.currentTime;
  let start = player.end;
  let firstOfItem = !player.segments.some((s) => !s.old);
  if (start < now + 0.01) start = now + (firstOfItem ? JITTER_LEAD_S : UNDERRUN_LEAD_S);
  const buf = c.createBuffer(1, f.length, RATE);
  buf.copyToChannel(f, 0);
  const src = c.createBufferSource();
  src.buffer = buf;
  src.connect(outGain);
  src.onended = () => { player.sources.delete(src); };
  src.start(start);
  player.sources.add(src);
  const dur = f.length / RATE;
  player.segments.push({ start, dur, old: false });
  player.end = start + dur;
  if (!player.timer) player.timer = setInterval(tickPlayback, 40);
  return firstOfItem ? performance.now() + (start - now) * 1000 : null;
}

// What has reached the speaker: the graph's clock minus the output device's latency (where the browser reports it).
function heardTime() {
  return ctx ? ctx.currentTime - (Number.isFinite(ctx.outputLatency) ? ctx.outputLatency : 0) : 0;
}

function playedMs() {
  if (!ctx) return 0;
  const now = heardTime();
  let ms = 0;
  for (const s of player.segments) if (!s.old) ms += Math.min(Math.max(now - s.start, 0), s.dur) * 1000;
  return ms;
}

function tickPlayback() {
  if (!ctx) return;
  const now = ctx.currentTime;
  const started = player.segments.some((s) => !s.old && now >= s.start);
  const playing = player.segments.some((s) => now >= s.start && now < s.start + s.dur);
  state.playedMs = Math.round(playedMs());
  if (started) state.playbackStarted = true;
  state.playing = playing;
  if (playing) setPill(ui.playback, 'playing', `playing ${(state.playedMs / 1000).toFixed(1)} s`);
  else if (now < player.end) setPill(ui.playback, 'buffering', 'buffering');
  else {
    setPill(ui.playback, 'idle', player.cutMs != null ? `interrupted at ${(player.cutMs / 1000).toFixed(1)} s`
      : state.playbackStarted ? `played ${(state.playedMs / 1000).toFixed(1)} s` : 'audio idle');
    if (!state.responseActive) { clearInterval(player.timer); player.timer = null; }
  }
}

// Stop every queued chunk now; returns ms of the current item that were actually heard.
function stopPlayback() {
  const ms = playedMs();
  for (const src of player.sources) { try { src.stop(); } catch (_) { /* not started */ } src.disconnect(); }
  player.sources.clear();
  if (ctx) player.end = ctx.currentTime;
  const cut = heardTime();
  for (const s of player.segments) s.dur = Math.min(s.dur, Math.max(cut - s.start, 0));
  state.playing = false;
  return ms;
}

// Barge-in: the user talks over a reply. Stop playback at once and tell the server how much audio was actually heard.
function bargeIn() {
  const rid = player.responseId;
  // Truncate when reply audio is queued, or when its response is still streaming (a gap between TTS chunks).
  const audioPending = !!(ctx && player.itemId && !interrupted.has(rid) &&
    (player.end > ctx.currentTime || (state.responseActive && cur && cur.responseId === rid)));
  if (!audioPending && !state.responseActive) return;
  const heard = Math.floor(stopPlayback());
  state.playedMs = heard;
  player.cutMs = heard;
  if (cur && cur.responseId) interrupted.add(cur.responseId);
  if (rid) interrupted.add(rid);
  if (audioPending) {
    send({ type: 'conversation.item.truncate', item_id: player.itemId, content_index: 0, audio_end_ms: heard });
    state.truncations += 1;
  }
  if (cur) { cur.interrupted = true; render(cur); }
  setPill(ui.playback, 'idle', `interrupted at ${(heard / 1000).toFixed(1)} s`);
}

// ------------------------------------------------------------------------------------------------------------ mic
const mic = { stream: null, ctx: null, src: null, node: null, sink: null };

async function startMic() {
  if (state.micOn || !state.connected) return;
  const c = ensureAudio();
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (e) {
    const why = e.name === 'NotAllowedError' ? 'permission denied'
      : e.name === 'NotFoundError' ? 'no microphone found'
      : !window.isSecureContext ? 'the page must be opened on https, localhost or 127.0.0.1'
      : e.message;
    showError(`Microphone unavailable: ${why}.`);
    return;
  }
  let capCtx = c;
  let src;
  try {
    src = capCtx.createMediaStreamSource(stream); // Chromium resamples the mic to the 24 kHz context
  } catch (_) {
    capCtx = new (window.AudioContext || window.webkitAudioContext)(); // Firefox: capture at device rate, worklet resamples
    src = capCtx.createMediaStreamSource(stream);
  }
  try {
    await capCtx.audioWorklet.addModule(new URL('./mic-worklet.js', import.meta.url));
  } catch (e) {
    stream.getTracks().forEach((tr) => tr.stop());
    showError(`Could not load the audio worklet: ${e.message}`);
    return;
  }
  const node = new AudioWorkletNode(capCtx, 'pcm-capture', { numberOfInputs: 1, numberOfOutputs: 1, channelCount: 1 });
  node.port.onmessage = (e) => onMicFrame(e.data);
  const sink = capCtx.createGain();
  sink.gain.value = 0; // keeps the worklet pulled by the graph, silently
  src.connect(node);
  node.connect(sink);
  sink.connect(capCtx.destination);
  if (capCtx.state === 'suspended') capCtx.resume().catch(() => {}); // never await: it hangs with no audio device
  watchAudio(capCtx);
  Object.assign(mic, { stream, ctx: capCtx === c ? null : capCtx, src, node, sink });
  state.micOn = true;
  if (vadOn()) setPill(ui.vad, 'idle', 'listening');
  micUi();
}

function stopMic() {
  if (!state.micOn && !mic.stream) return;
  if (state.talking) endTalk(false);
  try { mic.src && mic.src.disconnect(); mic.node && mic.node.disconnect(); mic.sink && mic.sink.disconnect(); } catch (_) {}
  if (mic.node) mic.node.port.onmessage = null;
  if (mic.stream) mic.stream.getTracks().forEach((tr) => tr.stop());
  if (mic.ctx) mic.ctx.close().catch(() => {});
  Object.assign(mic, { stream: null, ctx: null, src: null, node: null, sink: null });
  state.micOn = false;
  state.speaking = false;
  setPill(ui.vad, 'idle', 'mic off');
  micUi();
}

function b64FromBytes(u8) {
  let s = '';
  for (let i = 0; i < u8.length; i += 0x8000) s += String.fromCharCode.apply(null, u8.subarray(i, i + 0x8000));
  return btoa(s);
}

function onMicFrame(d) {
  if (!d || d.type !== 'pcm') return;
  ui.micLevel.style.width = `${Math.min(100, Math.round(Math.sqrt(d.rms) * 160))}%`;
  if (!state.connected) return;
  if (!vadOn() && !state.talking) return; // push-to-talk: only while the button is held/toggled on
  const bytes = new Uint8Array(d.pcm);
  if (send({ type: 'input_audio_buffer.append', audio: b64FromBytes(bytes) })) {
    samplesSent += bytes.length >> 1;
    state.audioSentMs = Math.round((samplesSent / RATE) * 1000);
    sentMarks.push([samplesSent - (bytes.length >> 1), performance.now() - ((bytes.length >> 1) / RATE) * 1000]);
    if (sentMarks.length > 600) sentMarks.splice(0, sentMarks.length - 600);
  }
}

// Push-to-talk (server VAD off): the press starts a turn (interrupting any reply), the release commits it.
let pressAt = 0;
function beginTalk() {
  if (state.talking) return;
  bargeIn();
  cancelActiveResponse();
  send({ type: 'input_audio_buffer.clear' });
  state.talking = true;
  newTurn('listening');
  setPill(ui.vad, 'speaking', 'recording');
  micUi();
}
function endTalk(commit = true) {
  if (!state.talking) return;
  state.talking = false;
  if (mic.node) mic.node.port.postMessage({ type: 'flush' });
  micUi();
  if (!commit) return;
  // Let the flushed tail frame reach the socket before committing.
  setTimeout(() => {
    if (cur) cur.anchor = performance.now();
    send({ type: 'input_audio_buffer.commit' });
    requestResponse();
    setPill(ui.vad, 'thinking', 'thinking');
  }, 30);
}

let pressed = false; // the pointer (or Space/Enter) is down on the mic button
async function onMicDown(ev) {
  if (ev.button != null && ev.button !== 0) return;
  ensureAudio();
  if (vadOn()) return; // VAD mode uses click (toggle)
  pressed = true;
  if (ev.pointerId != null) { try { ui.mic.setPointerCapture(ev.pointerId); } catch (_) { /* not a live pointer */ } }
  if (state.talking) { endTalk(true); pressAt = 0; return; } // tap-to-toggle: the second tap sends
  if (!state.micOn) await startMic();
  if (!state.micOn || state.talking) return;
  beginTalk();
  pressAt = pressed ? performance.now() : 0; // released while the mic was starting: that was a tap
}
function onMicUp() {
  pressed = false;
  if (vadOn() || !state.talking || !pressAt) return;
  if (performance.now() - pressAt >= HOLD_MS) endTalk(true); // held: the release sends
  pressAt = 0;                                              // tapped: keep talking until the next tap
}
function onMicClick() {
  if (!vadOn()) return;
  if (state.micOn) stopMic(); else startMic();
}

// One response at a time: a turn that arrives while a reply is still running cancels it, and its response.create waits
// for that reply's response.done (the server refuses a second active response).
let pendingCreate = false; // false, or the response fields of the response.create that waits
function cancelActiveResponse() {
  if (state.responseActive && !state.cancelling) {
    state.cancelling = true;
    send({ type: 'response.cancel' });
  }
}
function responseCreate(fields) {
  const response = { ...fields };
  const temp = temperature();
  if (temp != null) response.temperature = temp;
  return Object.keys(response).length ? { type: 'response.create', response } : { type: 'response.create' };
}
function requestResponse(fields = {}) {
  if (state.responseActive) {
    cancelActiveResponse();
    pendingCreate = fields;
  } else {
    send(responseCreate(fields));
  }
}

// ------------------------------------------------------------------------------------------------------------ text
function sendText(text) {
  text = (text == null ? ui.textInput.value : String(text)).trim();
  if (!text || !state.connected) return false;
  bargeIn();
  const t = newTurn('typed');
  t.user = text;
  t.userFinal = true;
  t.anchor = performance.now();
  render(t);
  send({
    type: 'conversation.item.create',
    item: { type: 'message', role: 'user', content: [{ type: 'input_text', text }] },
  });
  requestResponse();
  ui.textInput.value = '';
  return true;
}

// ------------------------------------------------------------------------------------------------------------ wiring
function init() {
  loadSettings();
  setConnection('disconnected');
  micUi();
  showLatency();
  newTurn('empty', false); // the live turn's placeholders, replaced by the first real turn
  ui.connect.addEventListener('click', () => (ws ? disconnect() : connect()));
  ui.textForm.addEventListener('submit', (e) => { e.preventDefault(); sendText(); });
  ui.mic.addEventListener('click', onMicClick);
  ui.mic.addEventListener('pointerdown', onMicDown);
  ui.mic.addEventListener('pointerup', onMicUp);
  ui.mic.addEventListener('pointercancel', onMicUp);
  ui.mic.addEventListener('keydown', (e) => {
    if ((e.key === ' ' || e.key === 'Enter') && !vadOn()) { e.preventDefault(); if (!e.repeat) onMicDown({}); }
  });
  ui.mic.addEventListener('keyup', (e) => { if ((e.key === ' ' || e.key === 'Enter') && !vadOn()) onMicUp(); });
  ui.errorClose.addEventListener('click', clearError);
  for (const el of [ui.instructions, ui.voice, ui.vadToggle, ui.silence, ui.maxTokens, ui.voiceName, ui.tools, ui.toolChoice]) {
    el.addEventListener('change', updateSession);
  }
  ui.temperature.addEventListener('change', saveSettings); // sent with each response.create, not in the session
  ui.eventFilter.addEventListener('input', filterEvents);
  ui.eventAudio.addEventListener('change', filterEvents);
  ui.eventClear.addEventListener('click', () => { ui.eventList.replaceChildren(); });
  if (window.matchMedia('(max-width: 900px)').matches) ui.events.open = false; // phones: the conversation first
  ui.vadToggle.addEventListener('change', () => { if (state.talking) endTalk(false); });
  ui.url.addEventListener('change', saveSettings);
  window.addEventListener('beforeunload', () => { userClosed = true; if (ws) ws.close(1000); });
  fetchModel();
  if (params.get('autoconnect') === '1') connect();
}

Object.defineProperty(window, 'rtserveDemo', {
  value: Object.freeze({
    get state() { return snapshot(); },
    connect, disconnect, sendText, startMic, stopMic,
  }),
  writable: false, configurable: false,
});

init();
