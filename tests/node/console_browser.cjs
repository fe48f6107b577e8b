// The console in a real browser (headless Chromium driven by playwright-core), as a user
// triages a dead letter: the overview lists the queue, the group's charts draw, the poison
// message is in the dead letters with its reason and body, replay asks for confirmation, and
// the replayed message is then seen completed. Prints one JSON line per observation; any
// failed expectation exits non-zero with what the page showed.
//
// Usage: node console_browser.cjs <console url> <queue> <group> <message id> <key as JSON>
//        <screenshot dir>; after "replayed" it waits for a line on stdin (the app completed it).
"use strict";
const { chromium } = require("playwright-core");
const fs = require("node:fs");
const path = require("node:path");

const [base, queue, group, id, keyJson, shots] = process.argv.slice(2);
const input = require("node:readline").createInterface({ input: process.stdin });
const lines = input[Symbol.asyncIterator]();
const nextLine = () => lines.next();
const chromiumPath = process.env.COSMOSQ_CHROMIUM || "/usr/bin/chromium";
const say = (step, detail = {}) => console.log(JSON.stringify({ step, ...detail }));

async function expectText(page, selector, text, timeout = 20000) {
  await page.waitForFunction(
    ([s, t]) => [...document.querySelectorAll(s)].some((el) => el.textContent.includes(t)),
    [selector, text],
    { timeout },
  );
}

(async () => {
  fs.mkdirSync(shots, { recursive: true });
  const browser = await chromium.launch({ executablePath: chromiumPath, args: ["--no-sandbox"] });
  const problems = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
    page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
    page.on("console", (m) => { if (m.type() === "error") problems.push(`console error: ${m.text()}`); });
    const shot = (name) => page.screenshot({ path: path.join(shots, `${name}.png`), fullPage: true });

    // Overview: the queue, its group, live updates connected.
    await page.goto(base);
    await expectText(page, "section.queue h2", queue);
    await page.waitForSelector(`a[href="/queues/${queue}/groups/${group}"]`);
    await page.waitForSelector("#live.on");
    const dead = await page.textContent(`[data-cell="${queue}/${group}/deadLetters"]`);
    say("overview", { queue, group, deadLetters: dead.trim() });
    await shot("overview");

    // The group: its charts draw lines once the console has two samples.
    await page.click(`a[href="/queues/${queue}/groups/${group}"]`);
    // Every chart has a line (the backlog's change needs three samples, the others two).
    await page.waitForFunction(
      () => [...document.querySelectorAll("figure.chart")].every((f) => f.querySelector("svg path")),
      null,
      { timeout: 20000 },
    );
    const charts = await page.$$eval("figure.chart", (figs) =>
      figs.map((f) => ({ title: f.querySelector(".title").textContent, drawn: !!f.querySelector("svg path") })));
    say("group", { charts });
    await shot("group");

    // Dark theme by its key.
    await page.keyboard.press("t");
    const theme = await page.evaluate(() => document.documentElement.dataset.theme);
    say("theme", { theme });
    await shot("group-dark");
    await page.keyboard.press("t");

    // The dead letters: the poison message with its reason.
    await page.click(`a[href="/queues/${queue}/groups/${group}/dead-letters"]`);
    await expectText(page, "table.dead td", id);
    const row = page.locator("table.dead tbody tr", { hasText: id });
    const reason = (await row.locator(".badge").textContent()).trim();
    say("dead letters", { id, reason, rows: await page.locator("table.dead tbody tr").count() });
    await shot("dead-letters");

    // Its message page: the body, and the group's state.
    await row.locator(`a:text-is("${id}")`).click();
    await page.waitForSelector("pre.body");
    const body = await page.textContent("pre.body");
    const state = (await page.textContent(`tr[data-group="${group}"] td.state`)).trim();
    say("message", { body: JSON.parse(body), state });
    await shot("message");
    await page.goBack();

    // Replay it: the confirmation page, then the result.
    await page.locator("table.dead tbody tr", { hasText: id }).locator('input[name="m"]').check();
    await page.click('button[name="action"][value="replay"]:text("Replay selected")');
    await page.waitForSelector("#confirm");
    const question = (await page.textContent("h1")).trim();
    say("confirm", { question });
    await shot("confirm");
    await page.click("#confirm");
    await page.waitForSelector("p.result");
    const result = (await page.textContent("p.result")).trim();
    say("replayed", { result });
    await shot("replayed");

    // The replayed message is delivered again (the test says when its app completed it):
    // its page says completed.
    await nextLine();
    await page.goto(`${base}queues/${queue}/messages?id=${encodeURIComponent(id)}&keyJson=${encodeURIComponent(keyJson)}`);
    const after = (await page.textContent(`tr[data-group="${group}"] td.state`)).trim();
    say("delivered", { state: after });
    await shot("message-completed");

    // Readable on a phone.
    await page.setViewportSize({ width: 390, height: 844 });
    await page.goto(base);
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    say("phone", { overflow });
    await shot("overview-phone");
  } catch (e) {
    problems.push(String(e && e.stack || e).slice(0, 2000));
  } finally {
    await browser.close();
    input.close();
    process.stdin.destroy();
  }
  if (problems.length) {
    say("problems", { problems });
    process.exit(1);
  }
})();
