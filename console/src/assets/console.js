// cosmosq console: live figures over server-sent events, the theme, and a few keys.
// Pages work without it; it only keeps them current.
(() => {
  "use strict";
  const root = document.documentElement;
  const saved = localStorage.getItem("cosmosq-theme");
  if (saved) root.dataset.theme = saved;

  document.addEventListener("DOMContentLoaded", () => {
    const theme = document.getElementById("theme");
    theme?.addEventListener("click", toggleTheme);

    const all = document.getElementById("select-all");
    all?.addEventListener("change", () => {
      for (const box of document.querySelectorAll('input[name="m"]')) box.checked = all.checked;
    });

    document.addEventListener("keydown", (e) => {
      if (e.target.closest("input, select, textarea") || e.metaKey || e.ctrlKey || e.altKey) return;
      if (e.key === "/") { const f = document.querySelector('input[name="id"]'); if (f) { e.preventDefault(); f.focus(); } }
      else if (e.key === "t") toggleTheme();
      else if (e.key === "a" && all) { all.checked = !all.checked; all.dispatchEvent(new Event("change")); }
      else if (e.key === "o") location.href = "/";
    });

    live();
  });

  function toggleTheme() {
    const dark = root.dataset.theme
      ? root.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    root.dataset.theme = dark ? "light" : "dark";
    localStorage.setItem("cosmosq-theme", root.dataset.theme);
  }

  // Each sampling round: the overview's cells and sparklines, a group's charts.
  function live() {
    const dot = document.getElementById("live");
    const events = new EventSource("/events");
    events.addEventListener("open", () => dot?.classList.add("on"));
    events.addEventListener("error", () => dot?.classList.remove("on"));
    events.addEventListener("round", async (e) => {
      const round = JSON.parse(e.data);
      // On the overview, a queue or group appeared or went away: its rows are not the right
      // ones any more (nor is a first "reading…" or an empty page).
      if (document.getElementById("overview")) {
        const shown = new Set([...document.querySelectorAll("[data-spark]")].map((el) => el.dataset.spark));
        const listed = round.groups.map((g) => g + "/spark");
        if (document.getElementById("waiting") || listed.length !== shown.size || listed.some((g) => !shown.has(g))) {
          location.reload();
          return;
        }
      }
      for (const el of document.querySelectorAll("[data-cell]")) {
        const value = round.cells[el.dataset.cell];
        if (value === undefined) continue;
        const link = el.querySelector("a");
        (link ?? el).textContent = value;
      }
      for (const el of document.querySelectorAll("[data-spark]")) {
        const svg = round.sparks[el.dataset.spark];
        if (svg !== undefined) el.innerHTML = svg; // drawn by the console: numbers only
      }
      const charts = document.getElementById("charts");
      if (charts?.dataset.src) {
        const answer = await fetch(charts.dataset.src, { headers: { accept: "text/html" } });
        if (answer.ok) charts.innerHTML = await answer.text();
      }
      const at = document.getElementById("round");
      if (at) at.textContent = "just now";
    });
  }
})();
