// Ratchet dashboard: loop actions behind the admin token, a task's content, auto-refresh.
//
// The admin token is pasted by the operator and kept in sessionStorage (this tab only,
// gone when it closes); it is sent as an Authorization header and never put in a cookie
// or a URL. Pages are server-rendered and work read-only without this script. A task's
// prompt and episodes are the loop's data: the page does not carry them, this script
// fetches them from the admin API with the token and sets them as text.
"use strict";

(() => {
  const TOKEN_KEY = "ratchet.adminToken";
  const FLASH_KEY = "ratchet.flash";
  const REFRESH_KEY = "ratchet.autoRefresh";

  const store = {
    get(key) {
      try {
        return window.sessionStorage.getItem(key);
      } catch (_) {
        return null;
      }
    },
    set(key, value) {
      try {
        window.sessionStorage.setItem(key, value);
      } catch (_) {
        // Storage may be disabled; actions then need the token pasted again.
      }
    },
    remove(key) {
      try {
        window.sessionStorage.removeItem(key);
      } catch (_) {
        // Nothing stored, nothing to remove.
      }
    },
  };

  const base = document.body.dataset.base || "";

  function show(element, text, kind) {
    element.textContent = text;
    element.dataset.kind = kind;
  }

  function errorText(response, body) {
    if (body && body.error && typeof body.error.message === "string") {
      return `${body.error.code || response.status}: ${body.error.message}`;
    }
    return `the server answered HTTP ${response.status}`;
  }

  function setUnlocked(section, unlocked) {
    section.querySelector("#action-panel").hidden = !unlocked;
    section.querySelector("#token-row").hidden = unlocked;
    section.querySelector("#readonly-note").hidden = unlocked;
    for (const button of section.querySelectorAll("button.action")) {
      button.disabled = !unlocked;
    }
  }

  async function perform(section, button, status) {
    const token = store.get(TOKEN_KEY);
    if (!token) {
      setUnlocked(section, false);
      show(status, "Paste the admin token first.", "error");
      return;
    }
    const question = button.dataset.confirm;
    if (question && !window.confirm(question)) {
      return;
    }
    const action = button.dataset.action;
    const reason = section.querySelector("#action-reason").value.trim();
    const url = `${base}/v1/loops/${encodeURIComponent(section.dataset.loop)}/${action}`;
    const buttons = section.querySelectorAll("button.action");
    for (const b of buttons) b.disabled = true;
    show(status, `${button.textContent.trim()}…`, "pending");
    try {
      const response = await fetch(url, {
        method: "POST",
        headers: {
          Authorization: `Bearer ${token}`,
          "Content-Type": "application/json",
          Accept: "application/json",
        },
        body: JSON.stringify(reason ? { reason } : {}),
        credentials: "omit",
        cache: "no-store",
      });
      let body = null;
      try {
        body = await response.json();
      } catch (_) {
        body = null;
      }
      if (response.ok) {
        store.set(FLASH_KEY, `${button.textContent.trim()}: accepted.`);
        window.location.reload();
        return;
      }
      show(status, errorText(response, body), "error");
    } catch (error) {
      show(status, `The request failed: ${error.message}`, "error");
    } finally {
      for (const b of buttons) b.disabled = false;
    }
  }

  function initActions() {
    const section = document.getElementById("actions");
    if (!section) return;
    const status = section.querySelector("#action-status");
    const input = section.querySelector("#admin-token");
    const save = () => {
      const token = input.value.trim();
      input.value = "";
      if (!token) {
        show(status, "The token is empty.", "error");
        return;
      }
      store.set(TOKEN_KEY, token);
      setUnlocked(section, true);
      show(status, "Actions unlocked for this tab.", "ok");
    };
    section.querySelector("#token-save").addEventListener("click", save);
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") {
        event.preventDefault();
        save();
      }
    });
    section.querySelector("#token-forget").addEventListener("click", () => {
      store.remove(TOKEN_KEY);
      setUnlocked(section, false);
      show(status, "Token forgotten; the page is read-only.", "ok");
    });
    for (const button of section.querySelectorAll("button.action")) {
      button.addEventListener("click", () => perform(section, button, status));
    }
    setUnlocked(section, Boolean(store.get(TOKEN_KEY)));
    const flash = store.get(FLASH_KEY);
    if (flash) {
      store.remove(FLASH_KEY);
      show(status, flash, "ok");
    }
  }

  function initAutoRefresh() {
    const seconds = Number(document.body.dataset.refreshSeconds || 0);
    const box = document.getElementById("auto-refresh");
    if (!box || !(seconds > 0)) return;
    box.checked = store.get(REFRESH_KEY) !== "off";
    box.addEventListener("change", () => store.set(REFRESH_KEY, box.checked ? "on" : "off"));
    window.setInterval(() => {
      const busy = Array.from(document.querySelectorAll("input[type=text], input[type=password]"))
        .some((field) => field.value !== "" || field === document.activeElement);
      if (box.checked && !busy && document.visibilityState === "visible") {
        window.location.reload();
      }
    }, seconds * 1000);
  }

  function adminGet(token, path) {
    return fetch(`${base}/v1/tasks/${path}`, {
      headers: { Authorization: `Bearer ${token}`, Accept: "application/json" },
      credentials: "omit",
      cache: "no-store",
    }).then((response) => {
      if (!response.ok) throw new Error(`the admin API answered HTTP ${response.status}`);
      return response.json();
    });
  }

  async function initTaskPage(token) {
    const holder = document.getElementById("task-content");
    if (!holder) return;
    const note = document.getElementById("task-content-note");
    const id = encodeURIComponent(holder.dataset.task);
    try {
      const [task, episodes] = await Promise.all([
        adminGet(token, id),
        adminGet(token, `${id}/demonstrations`),
      ]);
      const prompt = document.getElementById("task-prompt");
      prompt.textContent = task.prompt;
      prompt.hidden = false;
      for (const episode of episodes) {
        const cell = document.querySelector(
          `[data-demonstration-text="${CSS.escape(String(episode.id))}"]`,
        );
        if (cell) cell.textContent = episode.text;
      }
      note.hidden = true;
    } catch (error) {
      note.textContent = `The prompt and episodes could not be shown: ${error.message}.`;
    }
  }

  async function initClusterPrompts(token) {
    const previews = document.querySelectorAll("pre[data-task-prompt]");
    await Promise.all(
      Array.from(previews).map(async (pre) => {
        try {
          const task = await adminGet(token, encodeURIComponent(pre.dataset.taskPrompt));
          const limit = Number(pre.dataset.previewChars || 600);
          const text = String(task.prompt);
          pre.textContent = text.length > limit ? `${text.slice(0, limit)}…` : text;
          pre.hidden = false;
        } catch (_) {
          // The example stays a link to its task: the token may be wrong or gone.
        }
      }),
    );
  }

  function initLoopData() {
    const token = store.get(TOKEN_KEY);
    if (!token) return;
    initTaskPage(token);
    initClusterPrompts(token);
  }

  initActions();
  initAutoRefresh();
  initLoopData();
})();
