// Metrale chat: a static page that talks to this server's OpenAI-compatible API.
// No build step, no libraries. Model text only ever reaches the page through textContent
// (the markdown renderer builds DOM nodes), never through innerHTML.
"use strict";

const KEY_STORE = "metrale.apiKey";
const CHATS_STORE = "metrale.conversations";
const CURRENT_STORE = "metrale.current";
const SETTINGS_STORE = "metrale.settings";

const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
};

// ---- state ---------------------------------------------------------------------------
let cards = [];            // /v1/models entries
let chats = loadJSON(CHATS_STORE, []);
let currentId = localStorage.getItem(CURRENT_STORE);
let pendingImages = [];    // data: URLs to send with the next message
let controller = null;     // the AbortController of the answer being streamed
let keyWaiters = null;     // resolves when the key dialog closes

function loadJSON(name, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(name));
    return v ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(CHATS_STORE, JSON.stringify(chats));
    if (currentId) localStorage.setItem(CURRENT_STORE, currentId);
  } catch (e) {
    setStatus("Could not save the conversations in this browser (storage full?): " + e.message);
  }
}

function setStatus(text) { $("status").textContent = text; }

function current() {
  let chat = chats.find((c) => c.id === currentId);
  if (!chat) {
    chat = { id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random(),
             title: "New chat", created: Date.now(), messages: [] };
    chats.unshift(chat);
    currentId = chat.id;
    save();
  }
  return chat;
}

// ---- markdown (safe: DOM nodes and textContent only) -----------------------------------
function renderInline(text, parent) {
  // `code`, **bold**, *italic* / _italic_, [text](url) shown as "text (url)".
  const re = /(`+)([\s\S]*?)\1|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|_([^_\s][^_]*)_|\[([^\]]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    if (m[1]) parent.append(el("code", { text: m[2] }));
    else if (m[3] || m[4]) renderInline(m[3] || m[4], parent.appendChild(el("strong")));
    else if (m[5] || m[6]) renderInline(m[5] || m[6], parent.appendChild(el("em")));
    else {
      renderInline(m[7], parent.appendChild(el("span", { class: "link-text" })));
      parent.append(el("span", { class: "link-url", text: ` (${m[8]})` }));
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  let list = null;
  const flushPara = () => {
    if (para.length) {
      const p = el("p");
      para.forEach((line, i) => {
        if (i) p.append(el("br"));
        renderInline(line, p);
      });
      out.append(p);
      para = [];
    }
  };
  const flushList = () => { if (list) { out.append(list); list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
    if (fence) {
      flushPara(); flushList();
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      const code = el("code", { text: body.join("\n") });
      if (fence[2]) code.setAttribute("data-lang", fence[2]);
      out.append(el("pre", {}, code));  // an unclosed fence (still streaming) ends at the end
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushPara(); flushList();
      const h = el("h" + Math.min(6, heading[1].length + 2));
      renderInline(heading[2], h);
      out.append(h);
    } else if (bullet || numbered) {
      flushPara();
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) { flushList(); list = el(tag); }
      const li = el("li");
      renderInline((bullet || numbered)[1], li);
      list.append(li);
    } else if (!line.trim()) {
      flushPara(); flushList();
    } else {
      flushList();
      para.push(line);
    }
  }
  flushPara(); flushList();
  return out;
}

// ---- the API -------------------------------------------------------------------------
function askKey(message) {
  const dialog = $("key-dialog");
  $("key-message").textContent = message ||
    "This server needs an API key. It is kept in this browser only.";
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
  if (!keyWaiters) {
    keyWaiters = {};
    keyWaiters.promise = new Promise((resolve) => { keyWaiters.resolve = resolve; });
  }
  return keyWaiters.promise;
}

function closeKeyDialog(key) {
  $("key-dialog").close();
  if (key) localStorage.setItem(KEY_STORE, key);
  if (keyWaiters) { keyWaiters.resolve(Boolean(key)); keyWaiters = null; }
}

async function api(path, options = {}) {
  // fetch with the stored key; a 401 asks for a key and tries again.
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = localStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const body = await response.json().catch(() => ({}));
    const why = key ? "The API key was refused: " + (body.error?.message || "401") +
      ". Enter another." : null;
    if (!(await askKey(why))) return response;
  }
}

async function errorText(response) {
  const body = await response.json().catch(() => null);
  return `${response.status}: ${body?.error?.message || response.statusText}`;
}

async function clampMaxTokens(model, messages, wanted) {
  // What the context leaves after the prompt (POST /tokenize counts it), else the model's
  // context length (/v1/models' max_model_len); at least 1.
  let limit = cards.find((c) => c.id === model)?.max_model_len;
  try {
    const response = await api("/tokenize", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages }) });
    if (response.ok) {
      const counted = await response.json();
      limit = counted.max_model_len - counted.count;
    }
  } catch (e) { /* the context length alone */ }
  return limit ? Math.max(1, Math.min(Math.floor(wanted), limit)) : wanted;
}

async function loadModels() {
  const response = await api("/v1/models");
  if (!response.ok) { setStatus("Could not list the models: " + await errorText(response)); return; }
  cards = (await response.json()).data || [];
  const select = $("model");
  const saved = loadJSON(SETTINGS_STORE, {}).model;
  select.replaceChildren(...cards.map((c) =>
    el("option", { value: c.id, text: c.parent ? `${c.id} (adapter of ${c.parent})` : c.id })));
  if (cards.some((c) => c.id === saved)) select.value = saved;
  updateImagePicker();
}

function modalities(id) {
  const card = cards.find((c) => c.id === id);
  if (!card) return [];
  if (card.input_modalities) return card.input_modalities;
  const parent = cards.find((c) => c.id === card.parent);
  return parent?.input_modalities || ["text"];
}

function updateImagePicker() {
  const images = modalities($("model").value).includes("image");
  $("image-picker").hidden = !images;
  if (!images) { pendingImages = []; showAttachments(); }
}

// ---- the conversation ----------------------------------------------------------------
function renderList() {
  const list = $("conversations");
  list.replaceChildren(...chats.map((chat) => {
    const open = el("button", { type: "button", class: "open", text: chat.title || "New chat" });
    if (chat.id === currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => { if (!controller) { currentId = chat.id; save(); renderAll(); } });
    const del = el("button", { type: "button", class: "delete", text: "Delete",
                               "aria-label": `Delete conversation ${chat.title}` });
    del.addEventListener("click", () => {
      if (controller && chat.id === currentId) stop();
      chats = chats.filter((c) => c.id !== chat.id);
      if (currentId === chat.id) currentId = chats[0]?.id || null;
      save(); renderAll();
    });
    return el("li", {}, open, del);
  }));
}

function statsText(stats) {
  const parts = [];
  if (stats.tokens != null) parts.push(`${stats.tokens} ${stats.tokens === 1 ? "token" : "tokens"}`);
  if (stats.tps != null) parts.push(`${stats.tps.toFixed(1)} tokens/s`);
  if (stats.ttft != null) parts.push(`TTFT ${Math.round(stats.ttft)} ms`);
  return parts.join(" · ");
}

function renderMessage(msg) {
  const node = el("article", { class: "msg " + msg.role, "data-state": msg.state || "done" });
  node.append(el("h3", { class: "who", text: msg.role === "user" ? "You" : (msg.model || "Assistant") }));
  if (msg.reasoning) {
    const details = el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }));
    details.append(el("div", { class: "reasoning-text" }, renderMarkdown(msg.reasoning)));
    node.append(details);
  }
  const body = el("div", { class: "content" });
  if (msg.role === "user") body.append(...msg.content.split("\n").flatMap((l, i) => i ? [el("br"), l] : [l]));
  else body.append(renderMarkdown(msg.content || ""));
  node.append(body);
  for (const url of msg.images || []) node.append(el("img", { src: url, alt: "Attached image", class: "thumb" }));
  const foot = [];
  if (msg.stats) foot.push(statsText(msg.stats));
  if (msg.state === "stopped") foot.push("stopped");
  if (msg.finish === "length") foot.push("cut at max tokens");
  if (msg.error) node.append(el("p", { class: "error", role: "alert", text: msg.error }));
  if (foot.length) node.append(el("p", { class: "stats", text: foot.join(" · ") }));
  return node;
}

function renderMessages() {
  const chat = current();
  $("messages").replaceChildren(...chat.messages.map(renderMessage));
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderAll() {
  current();
  renderList();
  renderMessages();
}

function showAttachments() {
  const box = $("attachments");
  box.hidden = pendingImages.length === 0;
  box.replaceChildren(...pendingImages.map((url, i) => {
    const remove = el("button", { type: "button", text: "Remove", "aria-label": `Remove image ${i + 1}` });
    remove.addEventListener("click", () => { pendingImages.splice(i, 1); showAttachments(); });
    return el("span", { class: "attachment" }, el("img", { src: url, alt: `Image ${i + 1}`, class: "thumb" }), remove);
  }));
}

function apiMessages(chat) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of chat.messages) {
    if (m.role === "assistant" && !m.content && m.state !== "done") continue;
    if (m.role === "user" && m.images?.length) {
      out.push({ role: "user", content: [{ type: "text", text: m.content },
        ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))] });
    } else {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

function readSettings() {
  const settings = { model: $("model").value, system: $("system").value,
                     temperature: $("temperature").value, maxTokens: $("max-tokens").value,
                     extra: $("extra").value };
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(settings));
  return settings;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("prompt").value;
  if (controller || (!text.trim() && !pendingImages.length)) return;
  let extra = {};
  const settings = readSettings();
  if (settings.extra.trim()) {
    try { extra = JSON.parse(settings.extra); } catch (e) {
      setStatus("The extra parameters are not JSON: " + e.message); return;
    }
  }
  const chat = current();
  chat.messages.push({ role: "user", content: text, images: pendingImages.slice() });
  if (chat.title === "New chat") chat.title = text.trim().slice(0, 40) || "Image";
  // return_token_ids: every token's chunk carries its ids, even while its text is held back
  // (a partial UTF-8 character), so the token count, TTFT and tokens/s are exact.
  const body = { return_token_ids: true, ...extra, model: settings.model, messages: apiMessages(chat), stream: true,
                 stream_options: { include_usage: true } };
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  const answer = { role: "assistant", model: settings.model, content: "", reasoning: "", state: "streaming" };
  chat.messages.push(answer);
  $("prompt").value = "";
  pendingImages = []; showAttachments();
  save(); renderList(); renderMessages();
  setStatus("");
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let chunks = 0;  // tokens seen so far (the final usage has the exact count)
  let usage = null;
  let node = $("messages").lastElementChild;
  const redraw = () => {
    answer.stats = { tokens: usage?.completion_tokens ?? chunks,
                     ttft: first === null ? null : first - started };
    const elapsed = (performance.now() - (first ?? started)) / 1000;
    if (first !== null && elapsed > 0 && answer.stats.tokens > 1) answer.stats.tps = (answer.stats.tokens - 1) / elapsed;
    const fresh = renderMessage(answer);
    node.replaceWith(fresh);
    node = fresh;
  };
  try {
    // Unset, the server decides (the rest of the context); a value set is clamped to it.
    if (settings.maxTokens !== "") {
      body.max_tokens = await clampMaxTokens(settings.model, body.messages, Number(settings.maxTokens));
    }
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        for (const line of event.split(/\r?\n/)) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the server failed");
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const delta = choice.delta || {};
            const piece = (delta.content || "") + (delta.reasoning_content || "");
            const count = choice.token_ids ? choice.token_ids.length : (piece ? 1 : 0);
            if (count && first === null) first = performance.now();
            chunks += count;
            answer.content += delta.content || "";
            answer.reasoning += delta.reasoning_content || "";
            if (choice.finish_reason) answer.finish = choice.finish_reason;
          }
        }
      }
      redraw();
    }
    answer.state = "done";
  } catch (e) {
    if (e.name === "AbortError") answer.state = "stopped";
    else { answer.state = "error"; answer.error = e.message; }
  } finally {
    controller = null;
    setBusy(false);
    answer.stats = answer.stats || {};
    redraw();
    save();
    $("prompt").focus();
  }
}

function stop() {
  if (controller) controller.abort();
}

// ---- wiring --------------------------------------------------------------------------
function init() {
  const settings = loadJSON(SETTINGS_STORE, {});
  if (settings.system != null) $("system").value = settings.system;
  if (settings.temperature != null) $("temperature").value = settings.temperature;
  if (settings.maxTokens != null) $("max-tokens").value = settings.maxTokens;
  if (settings.extra != null) $("extra").value = settings.extra;

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && controller) { e.preventDefault(); stop(); } });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    if (controller) return;
    currentId = null; current(); renderAll(); $("prompt").focus();
  });
  $("model").addEventListener("change", () => { readSettings(); updateImagePicker(); });
  $("images").addEventListener("change", async (e) => {
    for (const file of e.target.files) {
      pendingImages.push(await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      }));
    }
    e.target.value = "";
    showAttachments();
  });
  $("set-key").addEventListener("click", () => askKey());
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const retrying = Boolean(keyWaiters);  // a request waits for the key and tries again
    closeKeyDialog($("api-key").value.trim());
    if (!retrying) loadModels();
  });
  $("key-cancel").addEventListener("click", () => closeKeyDialog(null));
  $("key-dialog").addEventListener("cancel", () => closeKeyDialog(null));

  renderAll();
  loadModels();
}

init();
