// onceflow view: actions with a confirmation step. Each button carries its endpoint and its
// JSON body; a first POST (confirm: false) says what would happen, the dialog asks, a second
// POST (confirm: true) does it. The result shows after the page reloads.
(function () {
  const base = document.body.dataset.base;
  const flash = document.getElementById("flash");
  const dialog = document.getElementById("confirm");

  function show(message, error) {
    flash.textContent = message;
    flash.className = error ? "error" : "";
    flash.hidden = false;
  }

  const kept = sessionStorage.getItem("onceflow-flash");
  if (kept) {
    sessionStorage.removeItem("onceflow-flash");
    const { message, error } = JSON.parse(kept);
    show(message, error);
  }

  async function post(path, body) {
    const response = await fetch(base + path, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Requested-By": "onceflow-view" },
      body: JSON.stringify(body),
    });
    let answer = {};
    try { answer = await response.json(); } catch (e) { answer = {}; }
    if (!response.ok) {
      const detail = typeof answer.detail === "string" ? answer.detail : JSON.stringify(answer.detail);
      throw new Error(`${response.status}: ${detail || response.statusText}`);
    }
    return answer;
  }

  function ask(title, message) {
    document.getElementById("confirm-title").textContent = title;
    document.getElementById("confirm-message").textContent = message;
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.showModal();
    });
  }

  // Links to Airflow's own pages (a DAG, a run). Embedded in Airflow's UI, this page is a
  // sandboxed iframe that may not navigate the top window: the UI's router is asked to go
  // there instead (same origin: its history, then the popstate its router listens to).
  document.querySelectorAll("a[target=_top]").forEach((link) => {
    link.addEventListener("click", (event) => {
      if (window.top === window || event.ctrlKey || event.metaKey || event.shiftKey) return;
      try {
        const top = window.top;
        top.history.pushState(null, "", link.href);
        top.dispatchEvent(new top.PopStateEvent("popstate", { state: null }));
        event.preventDefault();
      } catch (e) { /* not the same origin: let the browser try */ }
    });
  });

  document.querySelectorAll("button[data-post]").forEach((button) => {
    button.addEventListener("click", async () => {
      const path = button.dataset.post;
      const body = JSON.parse(button.dataset.body || "{}");
      button.disabled = true;
      try {
        const preview = await post(path, { ...body, confirm: false });
        const nothing = (preview.count === 0) || (Array.isArray(preview.txids) && preview.txids.length === 0);
        if (nothing) { show(preview.message, false); return; }
        if (!(await ask(button.dataset.title || button.textContent.trim(), preview.message))) return;
        const pinned = Array.isArray(preview.txids) ? { txids: preview.txids } : {};
        const done = await post(path, { ...body, ...pinned, confirm: true });
        sessionStorage.setItem("onceflow-flash", JSON.stringify({ message: done.message, error: false }));
        location.reload();
      } catch (error) {
        show(String(error.message || error), true);
      } finally {
        button.disabled = false;
      }
    });
  });
})();
