// Drive the demo page in a real headless Chromium (Debian's, not a downloaded build) with its fake
// camera: open the page, stream frames, wait for their replies, screenshot, stop.
//
//   DEMO_URL=http://127.0.0.1:8000/ DEMO_API_KEY=... DEMO_FRAMES=10 DEMO_SCREENSHOT=artifacts/demo.png \
//   DEMO_USER_DATA_DIR=$(mktemp -d) node clients/js/e2e/demo.e2e.mjs
//
// DEMO_TUNED=0 unchecks "tuned replies" (free text with a model that has tuned replies).
// DEMO_MODE=watch: frames are only watched (no replies); then DEMO_QUESTION is typed into the ask
// box and its streamed answer awaited.
//
// Prints one JSON line (the summary the pytest test checks) and exits 0, or exits 1 with the reason.
import { chromium } from "playwright-core";

const env = process.env;
const url = env.DEMO_URL || "http://127.0.0.1:8000/";
const frames = parseInt(env.DEMO_FRAMES || "10", 10);
const screenshot = env.DEMO_SCREENSHOT || "artifacts/demo.png";
const userDataDir = env.DEMO_USER_DATA_DIR;
const executablePath = env.CHROMIUM || "/usr/bin/chromium";
const timeoutMs = parseInt(env.DEMO_TIMEOUT_MS || "120000", 10);
const mode = env.DEMO_MODE || "reply";
const question = env.DEMO_QUESTION || "";
if (!userDataDir) throw new Error("DEMO_USER_DATA_DIR must name a fresh directory");

const FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--use-fake-device-for-media-stream",
  "--use-fake-ui-for-media-stream",
];

const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath,
  headless: true,
  args: FLAGS,
  viewport: { width: 1280, height: 1000 },
  timeout: 60000,
});
const consoleLines = [];
const pageErrors = [];
let page = null;
try {
  page = context.pages()[0] || (await context.newPage());
  page.on("console", (msg) => consoleLines.push(`${msg.type()}: ${msg.text()}`));
  page.on("pageerror", (err) => pageErrors.push(String(err)));
  await page.goto(url, { waitUntil: "load" });
  await page.waitForFunction(() => window.demo !== undefined, null, { timeout: 15000 });

  const fill = async (id, value) => page.fill(`#${id}`, String(value));
  if (env.DEMO_API_KEY) await fill("api-key", env.DEMO_API_KEY);
  await fill("fps", env.DEMO_FPS || "5");
  await fill("size", env.DEMO_WIDTH || "112");
  await fill("window", env.DEMO_WINDOW || "4");
  await fill("max-tokens", env.DEMO_MAX_TOKENS || "4");
  await fill("prompt", env.DEMO_PROMPT || "What changed?");
  await page.selectOption("#mode", mode);
  // DEMO_TUNED=0: free text (the "tuned replies" box unchecked); by default the page's own choice.
  if (env.DEMO_TUNED === "0") await page.uncheck("#tuned");
  await page.click("#start");

  if (mode === "watch") {
    await page.waitForFunction(
      (n) => window.demo.state.dones.filter((d) => d.status === "ingested").length >= n || window.demo.state.status === "error",
      frames,
      { timeout: timeoutMs, polling: 100 },
    );
    if (question) {
      await fill("question", question);
      await page.click("#ask");
      await page.waitForFunction(
        () => document.querySelectorAll("#replies li.answer").length >= 1 || window.demo.state.status === "error",
        null,
        { timeout: timeoutMs, polling: 100 },
      );
    }
  } else {
    await page.waitForFunction(
      // The page keeps its newest 60 replies on screen; the state keeps all of them.
      (n) => window.demo.state.dones.filter((d) => d.status !== "ingested").length >= n || window.demo.state.status === "error",
      frames,
      { timeout: timeoutMs, polling: 100 },
    );
  }
  // Let the plots and the last reply settle, then look at the page as a person would.
  await page.waitForTimeout(300);
  const summary = await page.evaluate(() => {
    const inked = (id) => {
      const c = document.getElementById(id);
      const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      const colours = new Set();
      for (let i = 0; i < data.length; i += 4 * 7) colours.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
      return colours.size;
    };
    const s = window.demo.state;
    return {
      status: s.status,
      errors: s.errors,
      sent: s.sent,
      dropped: s.dropped,
      sessions: s.sessions,
      secrets: s.secrets,
      dones: s.dones,
      dom: [...document.querySelectorAll("#replies li")].map((li) => ({
        frame_index: Number(li.dataset.frameIndex),
        frame_id: li.dataset.frameId,
        session: Number(li.dataset.session),
        question: li.dataset.question ?? null,
        text: li.querySelector(".text").textContent,
      })),
      current: document.getElementById("current").textContent,
      statReplies: document.getElementById("stat-replies").textContent,
      statWatched: document.getElementById("stat-watched").textContent,
      model: document.getElementById("stat-model").textContent,
      video: { width: document.getElementById("video").videoWidth, height: document.getElementById("video").videoHeight },
      plotColours: { latency: inked("plot-latency"), retention: inked("plot-retention") },
    };
  });
  await page.screenshot({ path: screenshot, fullPage: true });
  await page.click("#stop");
  await page.waitForFunction(() => window.demo.state.status === "stopped", null, { timeout: 15000 });
  summary.finalStatus = await page.evaluate(() => window.demo.state.status);
  summary.pageErrors = pageErrors;
  summary.console = consoleLines.slice(-20);
  console.log(JSON.stringify(summary));
} catch (err) {
  console.error(`demo e2e failed: ${err && err.stack ? err.stack : err}`);
  console.error(`page errors: ${JSON.stringify(pageErrors)}\nconsole: ${JSON.stringify(consoleLines.slice(-20))}`);
  const state = page ? await page.evaluate(() => JSON.stringify(window.demo?.state ?? null)).catch(() => null) : null;
  console.error(`page state: ${state}`);
  process.exitCode = 1;
} finally {
  await context.close();
}
