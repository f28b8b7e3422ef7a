// The webcam demo page: camera → canvas → JPEG → RealtimeClient, one frame in flight.
// realtime-client.js is served from clients/js (a symlink in realtime/static: one source).
import { RealtimeClient } from "./realtime-client.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // points kept on the plots
const MAX_REPLIES = 60; // replies kept on the page

const video = $("video");
const canvas = $("capture");
const ctx = canvas.getContext("2d");

// Model name -> the response_format of its tuned replies (training/page_formats.py). With such a
// model the page constrains every reply to what the model was tuned to say, unless "tuned
// replies" is unchecked: a 135M model asked in free text can drift into copying an old reply.
const tunedFormats = fetch(new URL("./tuned-replies.json", import.meta.url))
  .then((res) => (res.ok ? res.json() : {}))
  .catch(() => ({}));
let tuned = {};
tunedFormats.then((formats) => {
  tuned = formats;
});

/** The response_format of this frame's reply: the model's tuned one when asked for, else none. */
function replyFormat(client) {
  const model = client.config && client.config.model;
  return $("tuned").checked && model && tuned[model] ? tuned[model] : null;
}

/** What a person reads: a constrained reply is a JSON string, shown without its quotes. */
function readable(text, constrained) {
  if (!constrained) return text;
  try {
    return JSON.parse(text);
  } catch {
    return text.replace(/^"/, "").replace(/"$/, ""); // streaming: the string is not closed yet
  }
}

const state = {
  status: "idle",
  running: false,
  client: null,
  media: null,
  timer: null,
  frameNo: 0,
  sessions: 0,
  secrets: 0, // client secrets minted (when this server serves the page)
  sent: 0,
  dropped: 0,
  dones: [], // one entry per reply or watched frame, across sessions
  errors: [],
  question: null, // asked, waiting for the next free turn
  answers: 0,
};
// For people poking around in the console, and for the browser test.
window.demo = { state, start, stop };

const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

function setStatus(text, kind = text) {
  state.status = kind;
  $("status").textContent = text;
  $("status").dataset.state = kind;
}

function log(message, isError = false) {
  const li = document.createElement("li");
  li.textContent = `${new Date().toLocaleTimeString()}  ${message}`;
  if (isError) li.className = "error";
  $("log").prepend(li);
  while ($("log").children.length > 50) $("log").lastChild.remove();
}

function settings() {
  return {
    url: $("url").value.trim(),
    apiKey: $("api-key").value || null,
    instructions: $("instructions").value.trim() || null,
    window: clamp(parseInt($("window").value, 10) || 0, 0, 256),
    maxTokens: clamp(parseInt($("max-tokens").value, 10) || 32, 1, 4096),
  };
}

// "watch": frames are only taken in (frame.append with reply: false) and questions from the
// ask box are answered between them; "reply": every frame is answered.
const watching = () => $("mode").value === "watch";

const fps = () => clamp(parseFloat($("fps").value) || 2, 0.2, 30);
const captureWidth = () => clamp(parseInt($("size").value, 10) || 224, 56, 1280);

function setRunning(running) {
  state.running = running;
  $("start").disabled = running;
  $("stop").disabled = !running;
  for (const id of ["url", "api-key", "instructions", "window", "max-tokens", "size"]) $(id).disabled = running;
  $("question").disabled = !running;
  $("ask").disabled = !running;
}

// ------------------------------------------------------------------ session

async function start() {
  if (state.running) return;
  setRunning(true);
  try {
    setStatus("starting camera…", "starting");
    state.media = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: false });
    video.srcObject = state.media;
    await video.play();
    await tunedFormats;
    await openSession();
    schedule();
  } catch (err) {
    fail(err);
    await stop({ keepStatus: true });
  }
}

// When this very server serves the page, trade the typed key for a short-lived client secret
// (docs/protocol.md, "Browser credentials") and connect with that: the key itself never goes
// over the WebSocket. A page served elsewhere would get its secret from its own backend.
async function credential(s) {
  const target = new URL(s.url, location.href);
  const sameServer = location.protocol.startsWith("http") && target.host === location.host;
  if (!sameServer) return s.apiKey;
  const headers = { "Content-Type": "application/json" };
  if (s.apiKey) headers.Authorization = `Bearer ${s.apiKey}`;
  const res = await fetch("/v1/realtime/client_secrets", { method: "POST", headers, body: "{}" });
  if (res.status === 404) return s.apiKey; // a server without client secrets
  const body = await res.json().catch(() => null);
  if (!res.ok) {
    const err = new Error(body?.error?.message || `client secret: HTTP ${res.status}`);
    err.code = body?.error?.code || "connection_failed";
    throw err;
  }
  state.secrets += 1;
  return body.client_secret;
}

async function openSession() {
  const s = settings();
  setStatus("connecting…", "connecting");
  const client = await RealtimeClient.connect(s.url, { apiKey: await credential(s), timeoutMs: 120000 });
  state.client = client;
  client.on("close", () => onSessionEnded(client));
  // Resumable: a Wi-Fi hiccup resumes the same session; a server restart moves to a new one.
  client.on("resumed", (e) => log(`connection dropped and resumed: next frame ${e.next_frame_index}`));
  client.on("reopened", (e) => {
    state.sessions += 1;
    log(`the server restarted: new session ${e.session_id}`);
  });
  client.on("server.draining", (e) => log(`the server is shutting down (${e.seconds_left.toFixed(0)} s left)`));
  const retention = s.window > 0 ? { window_chunks: s.window } : { enabled: false };
  const opened = await client.open({
    instructions: s.instructions,
    retention,
    sampling: { max_tokens: s.maxTokens },
    resumable: { grace_s: 30 },
    // What this page sends: single images, at the chosen pace (admission reserves for it).
    limits: { max_clip_frames: 1, frames_per_s: fps() },
  });
  state.sessions += 1;
  $("stat-model").textContent = opened.config.model;
  $("stat-model").title = opened.config.model;
  const win = opened.config.retention.enabled ? opened.config.retention.window_chunks ?? "∞" : "off";
  log(`session ${opened.session_id} opened: window ${win}, max_tokens ${opened.config.sampling.max_tokens}`);
  if (tuned[opened.config.model]) {
    log(`${opened.config.model}: replies are its tuned descriptions (uncheck "tuned replies" for free text)`);
  }
  setStatus("streaming");
}

function onSessionEnded(client) {
  if (client !== state.client) return;
  state.client = null;
  if (!state.running) return;
  const why = client.fatal ? client.fatal.message : client.closedEvent ? client.closedEvent.reason : "the connection closed";
  log(`session ended: ${why}`, true);
  if (!$("auto-restart").checked) {
    setStatus(`ended: ${client.fatal ? client.fatal.code : "closed"}`, "error");
    stop({ keepStatus: true });
    return;
  }
  setStatus("reopening…", "connecting");
  setTimeout(() => {
    if (state.running && !state.client) openSession().catch((err) => fail(err));
  }, 500);
}

async function stop({ keepStatus = false } = {}) {
  clearInterval(state.timer);
  state.timer = null;
  const client = state.client;
  state.client = null;
  setRunning(false);
  if (client) await client.close().catch(() => {});
  if (state.media) {
    for (const track of state.media.getTracks()) track.stop();
    state.media = null;
    video.srcObject = null;
  }
  if (!keepStatus) setStatus("stopped");
}

function fail(err) {
  const message = err && err.message ? err.message : String(err);
  state.errors.push(message);
  log(message, true);
  setStatus(`error: ${err && err.code ? err.code : "failed"}`, "error");
}

// ------------------------------------------------------------------ frames

function schedule() {
  clearInterval(state.timer);
  state.timer = setInterval(tick, 1000 / fps());
}

function capture() {
  const w = captureWidth();
  const vw = video.videoWidth || 640;
  const vh = video.videoHeight || 480;
  canvas.width = w;
  canvas.height = Math.max(28, Math.round((w * vh) / vw));
  ctx.drawImage(video, 0, 0, canvas.width, canvas.height);
  return new Promise((resolve, reject) =>
    canvas.toBlob((blob) => (blob ? resolve(blob) : reject(new Error("canvas.toBlob failed"))), "image/jpeg", 0.85),
  );
}

function tick() {
  const client = state.client;
  if (!client || !client.opened || client.closed) return;
  if (client.busy) {
    // One frame in flight: a live camera drops frames instead of queueing them.
    state.dropped += 1;
    updateStats();
    return;
  }
  const started = performance.now();
  if (state.question !== null) {
    // A question goes in the next free turn, between two frames; its answer streams in.
    const question = state.question;
    state.question = null;
    showCurrent("?", "");
    client
      .ask(question, {
        frameId: `ask-${state.answers}`,
        timestamp: started / 1000,
        onDelta: (_delta, text, event) => showCurrent(`#${event.frame_index} ?`, text),
      })
      .then((done) => onDone(done, performance.now() - started, question))
      .catch((err) => {
        if (!client.closed) fail(err);
      });
    return;
  }
  const frameId = `cam-${state.frameNo++}`;
  const watch = watching();
  state.sent += 1;
  if (!watch) showCurrent("…", "");
  const prompt = watch ? null : $("prompt").value.trim() || null;
  const responseFormat = watch ? null : replyFormat(client);
  const constrained = responseFormat !== null;
  client
    .offerFrame(capture, {
      prompt,
      frameId,
      reply: !watch,
      responseFormat,
      timestamp: started / 1000,
      onDelta: (_delta, text, event) => showCurrent(`#${event.frame_index}`, readable(text, constrained)),
    })
    .then((done) => {
      if (done) onDone(done, performance.now() - started, null, constrained);
    })
    .catch((err) => {
      if (!client.closed) fail(err);
    });
  updateStats();
}

function showCurrent(label, text) {
  $("current-index").textContent = label;
  $("current").textContent = text;
}

function onDone(done, wallMs, question = null, constrained = false) {
  const entry = {
    question,
    session: state.sessions,
    frame_index: done.frame_index,
    frame_id: done.frame_id,
    status: done.status,
    text: readable(done.text, constrained),
    constrained,
    total_ms: done.timing.total_ms ?? wallMs,
    ttft_ms: done.timing.ttft_ms,
    wall_ms: wallMs,
    frames_retained: done.retention?.frames_retained ?? null,
    kv_blocks_held: done.retention?.kv_blocks_held ?? null,
    tokens_retained: done.retention?.tokens_retained ?? null,
  };
  state.dones.push(entry);
  if (question !== null) state.answers += 1;
  updateStats();
  drawPlots();
  if (done.status === "ingested") return; // watched: nothing to show but the counters
  showCurrent(`#${done.frame_index}`, entry.text);
  addReply(entry);
  updateStats();
  drawPlots();
}

function addReply(entry) {
  const li = document.createElement("li");
  li.dataset.frameIndex = String(entry.frame_index);
  li.dataset.frameId = entry.frame_id ?? "";
  li.dataset.status = entry.status;
  li.dataset.session = String(entry.session);
  const index = document.createElement("span");
  index.className = "index";
  index.textContent = `#${entry.frame_index}`;
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = entry.text;
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `${Math.round(entry.total_ms)} ms${entry.status === "completed" ? "" : " · " + entry.status}`;
  li.append(index, text, meta);
  if (entry.question !== null) {
    // An answer to a question from the ask box: the question above it.
    li.dataset.question = entry.question;
    li.classList.add("answer");
    const asked = document.createElement("span");
    asked.className = "question";
    asked.textContent = `Q: ${entry.question}`;
    li.prepend(asked);
  }
  $("replies").prepend(li);
  while ($("replies").children.length > MAX_REPLIES) $("replies").lastChild.remove();
}

function updateStats() {
  $("stat-sent").textContent = String(state.sent);
  $("stat-replies").textContent = String(state.dones.filter((d) => d.status !== "ingested").length);
  $("stat-watched").textContent = String(state.dones.filter((d) => d.status === "ingested").length);
  $("stat-dropped").textContent = String(state.dropped);
  const last = state.dones[state.dones.length - 1];
  if (last) {
    $("stat-latency").textContent = `${Math.round(last.total_ms)} ms`;
    if (last.kv_blocks_held !== null) $("stat-blocks").textContent = String(last.kv_blocks_held);
  }
}

// ------------------------------------------------------------------ plots (plain canvas)

/** A round axis top for `value` that splits into 4 round steps (4, 6, 8, 10, 12, 16, 20, …). */
function niceMax(value) {
  if (!(value > 0)) return 4;
  const step = value / 4;
  const pow = 10 ** Math.floor(Math.log10(step));
  for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * pow >= step) return 4 * m * pow;
  return 40 * pow;
}

/** A line chart: `series` = [{ values, color, axis: "left" | "right" }], x = reply number. */
function drawChart(el, series, { firstX = 0, right = false } = {}) {
  const g = el.getContext("2d");
  const W = el.width;
  const H = el.height;
  const pad = { l: 46, r: right ? 46 : 14, t: 12, b: 24 };
  const plotW = W - pad.l - pad.r;
  const plotH = H - pad.t - pad.b;
  g.clearRect(0, 0, W, H);
  g.fillStyle = css("--panel") || "#171b21";
  g.fillRect(0, 0, W, H);
  g.font = "11px 'DejaVu Sans', sans-serif";
  const n = Math.max(0, ...series.map((s) => s.values.length));
  const maxOf = (axis) => niceMax(Math.max(0, ...series.filter((s) => s.axis === axis).flatMap((s) => s.values.filter((v) => v != null))) * 1.1);
  const axes = { left: maxOf("left"), right: maxOf("right") };
  // grid + y labels
  g.strokeStyle = css("--line") || "#2a313a";
  g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + (plotH * i) / 4;
    g.beginPath();
    g.moveTo(pad.l, y);
    g.lineTo(W - pad.r, y);
    g.stroke();
    g.fillStyle = css("--muted") || "#8c96a3";
    g.textAlign = "right";
    g.fillText(formatTick(axes.left * (1 - i / 4)), pad.l - 6, y + 4);
    if (right) {
      g.textAlign = "left";
      g.fillText(formatTick(axes.right * (1 - i / 4)), W - pad.r + 6, y + 4);
    }
  }
  if (n === 0) {
    g.textAlign = "center";
    g.fillText("waiting for replies…", pad.l + plotW / 2, pad.t + plotH / 2);
    return;
  }
  // x labels: reply numbers
  g.textAlign = "left";
  g.fillText(String(firstX), pad.l, H - 6);
  g.textAlign = "right";
  g.fillText(String(firstX + n - 1), W - pad.r, H - 6);
  const x = (i) => pad.l + (n === 1 ? plotW / 2 : (plotW * i) / (n - 1));
  for (const s of series) {
    const top = axes[s.axis];
    const y = (v) => pad.t + plotH * (1 - v / top);
    g.strokeStyle = s.color;
    g.fillStyle = s.color;
    g.lineWidth = 2;
    g.beginPath();
    let pen = false;
    s.values.forEach((v, i) => {
      if (v == null) {
        pen = false;
        return;
      }
      if (pen) g.lineTo(x(i), y(v));
      else g.moveTo(x(i), y(v));
      pen = true;
    });
    g.stroke();
    if (n <= 40) {
      s.values.forEach((v, i) => {
        if (v == null) return;
        g.beginPath();
        g.arc(x(i), y(v), 2.5, 0, 2 * Math.PI);
        g.fill();
      });
    }
  }
}

function formatTick(v) {
  if (v >= 1000) return `${+(v / 1000).toFixed(1)}k`;
  return Number.isInteger(v) ? String(v) : String(+v.toFixed(1));
}

function drawPlots() {
  const recent = state.dones.slice(-HISTORY);
  const firstX = state.dones.length - recent.length;
  drawChart(
    $("plot-latency"),
    [
      { values: recent.map((d) => d.total_ms), color: css("--total"), axis: "left" },
      { values: recent.map((d) => d.ttft_ms), color: css("--ttft"), axis: "left" },
    ],
    { firstX },
  );
  drawChart(
    $("plot-retention"),
    [
      { values: recent.map((d) => d.frames_retained), color: css("--frames"), axis: "left" },
      { values: recent.map((d) => d.kv_blocks_held), color: css("--blocks"), axis: "right" },
    ],
    { firstX, right: true },
  );
}

// ------------------------------------------------------------------ wiring

$("url").value = location.protocol.startsWith("http")
  ? `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`
  : "ws://127.0.0.1:8000/v1/realtime";
$("controls").addEventListener("submit", (event) => {
  event.preventDefault();
  start();
});
$("stop").addEventListener("click", () => stop());
$("ask-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question || !state.running) return;
  state.question = question; // sent at the next tick, when no chunk is in flight
  $("question").value = "";
  log(`asked: ${question}`);
});
$("fps").addEventListener("change", () => {
  if (state.running) schedule();
});
window.addEventListener("beforeunload", () => {
  if (state.client) state.client.close({ timeoutMs: 200 });
});
drawPlots();
