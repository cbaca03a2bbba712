// The live page: submit over WS /v1/stream (on the model and adapter chosen from GET /v1/models),
// show the answer token by token, resume a dropped socket from the last event id, and poll
// GET /v1/queue every second. No dependencies.
// Model text only ever goes into the page as text (Text nodes / textContent), never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    form: $("ask-form"), prompt: $("prompt"), maxTokens: $("max-tokens"),
    temperature: $("temperature"), apiKey: $("api-key"), send: $("send"),
    outputFormat: $("output-format"), jsonSchema: $("json-schema"),
    jsonSchemaLabel: $("json-schema-label"),
    model: $("model"), adapter: $("adapter"), modelsRefresh: $("models-refresh"),
    modelsNote: $("models-note"),
    jobId: $("job-id"), status: $("status"), tokenCount: $("token-count"),
    finishReason: $("finish-reason"), usage: $("usage"), note: $("note"), error: $("error"),
    output: $("output"), queue: $("queue"), queueNote: $("queue-note"), workers: $("workers"),
    running: $("running"), tokensPerS: $("tokens-per-s"), lanes: $("lanes"),
    workerList: $("worker-list"),
  };
  const KEY_STORAGE = "tidegate.apiKey";
  const QUEUE_EVERY_MS = 1000;
  const RESUME_DELAY_MS = 300;
  const KEY_SETTLE_MS = 400; // the models are reloaded once the key stops changing

  // ------------------------------------------------------------------ API key

  try {
    el.apiKey.value = localStorage.getItem(KEY_STORAGE) || "";
  } catch (_) { /* storage disabled: the key just is not remembered */ }
  let keySettling = null;
  el.apiKey.addEventListener("input", () => {
    try {
      const key = el.apiKey.value.trim();
      if (key) localStorage.setItem(KEY_STORAGE, key);
      else localStorage.removeItem(KEY_STORAGE);
    } catch (_) { /* ignore */ }
    // Which models a caller may list depends on the key.
    clearTimeout(keySettling);
    keySettling = setTimeout(loadModels, KEY_SETTLE_MS);
  });
  const apiKey = () => el.apiKey.value.trim();

  function authHeaders() {
    const key = apiKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // ------------------------------------------------------------------ model and adapter

  // GET /v1/models lists each served base model (with live_workers), followed by its adapters
  // ("base:name" entries with a parent). The first model is chosen at first. Without a list
  // (refused, unreachable, empty) the page sends no model field: the default model runs.
  let modelList = []; // [{id, adapters: [name, ...]}], in the server's order
  let modelsLoad = 0; // only the latest load fills the selects
  let served = null; // what the live workers serve, as the queue panel last saw it

  function option(value, label) {
    const node = document.createElement("option");
    node.value = value;
    node.textContent = label;
    return node;
  }

  function parseModels(body) {
    const data = body && Array.isArray(body.data) ? body.data : [];
    const named = data.filter((m) => m && typeof m.id === "string");
    // Only what a live worker serves is offered (every served model is listed, with its
    // live_workers count).
    const bases = named.filter((m) => !m.parent && !(m.live_workers === 0))
      .map((m) => ({ id: m.id, adapters: [] }));
    for (const m of named) {
      const base = bases.find((b) => b.id === m.parent);
      if (base && m.id.startsWith(`${m.parent}:`)) {
        base.adapters.push(m.id.slice(m.parent.length + 1));
      }
    }
    return bases;
  }

  function showModelsNote(text) {
    el.modelsNote.textContent = text;
    el.modelsNote.hidden = !text;
  }

  function fillModels(list, note) {
    const chosen = el.model.value;
    modelList = list;
    el.model.replaceChildren(...(list.length ? list.map((m) => option(m.id, m.id))
                                             : [option("", "default")]));
    el.model.disabled = !list.length;
    if (list.some((m) => m.id === chosen)) el.model.value = chosen;
    fillAdapters();
    showModelsNote(note);
  }

  function fillAdapters() {
    const chosen = el.adapter.value;
    const model = modelList.find((m) => m.id === el.model.value);
    const adapters = model ? model.adapters : [];
    el.adapter.replaceChildren(option("", "none"), ...adapters.map((a) => option(a, a)));
    el.adapter.disabled = !adapters.length;
    if (adapters.includes(chosen)) el.adapter.value = chosen;
  }

  async function fetchModels() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
    } catch (_) {
      return [[], "Models unavailable (offline): jobs go to the default model."];
    }
    if (!response.ok) {
      return [[], `Models unavailable (${response.status}): jobs go to the default model.`];
    }
    let list;
    try {
      list = parseModels(await response.json());
    } catch (_) {
      return [[], "Models unreadable: jobs go to the default model."];
    }
    return [list, list.length ? "" : "No model is served yet: jobs go to the default model."];
  }

  async function loadModels() {
    const load = ++modelsLoad;
    const [list, note] = await fetchModels();
    if (load === modelsLoad) fillModels(list, note);
  }

  // Reload when the queue panel shows a worker (or an adapter) come or go.
  function noteServed(workers) {
    const now = [...new Set(workers.map((w) => `${w.model} ${[].concat(w.adapters ?? [])}`))]
      .sort().join("|");
    if (served !== null && now !== served) loadModels();
    served = now;
  }

  el.model.addEventListener("change", fillAdapters);
  el.modelsRefresh.addEventListener("click", loadModels);

  // ------------------------------------------------------------------ answer panel

  let outputText = document.createTextNode("");
  el.output.replaceChildren(outputText);

  function setStatus(state, label) {
    el.status.dataset.state = state;
    el.status.textContent = label || state;
  }

  function showNote(text) {
    el.note.textContent = text || "";
    el.note.hidden = !text;
  }

  function showError(message, fields, status) {
    const parts = [];
    const head = document.createElement("strong");
    head.textContent = (message || "error") + (status ? ` (${status})` : "");
    parts.push(head);
    // A lone field whose "field: reason" is already the message adds nothing.
    const repeats = Array.isArray(fields) && fields.length === 1 &&
                    `${fields[0].field}: ${fields[0].reason}` === message;
    if (Array.isArray(fields) && fields.length && !repeats) {
      const list = document.createElement("ul");
      for (const f of fields) {
        const item = document.createElement("li");
        const name = document.createElement("code");
        name.textContent = String(f.field ?? "");
        item.append(name, ": " + String(f.reason ?? ""));
        list.append(item);
      }
      parts.push(list);
    }
    el.error.replaceChildren(...parts);
    el.error.hidden = false;
  }

  function clearOutput() {
    outputText = document.createTextNode("");
    el.output.replaceChildren(outputText);
  }

  function appendOutput(text) {
    const box = el.output;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    outputText.appendData(text);
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function resetAnswer() {
    clearOutput();
    el.jobId.textContent = "–";
    el.tokenCount.textContent = "–";
    el.finishReason.textContent = "–";
    el.usage.textContent = "–";
    el.error.hidden = true;
    el.error.replaceChildren();
    showNote("");
  }

  // ------------------------------------------------------------------ one job over a socket

  let job = null; // the job this page shows; frames of an older one are ignored

  function buildRequest() {
    const text = el.prompt.value;
    // A blank prompt has no user message: the server's validation explains what is missing.
    const request = { messages: text.trim() ? [{ role: "user", content: text }] : [] };
    if (el.model.value) request.model = el.model.value;
    if (el.model.value && el.adapter.value) request.lora = el.adapter.value;
    const maxTokens = el.maxTokens.value.trim();
    if (maxTokens !== "") request.max_tokens = Number(maxTokens);
    const temperature = el.temperature.value.trim();
    if (temperature !== "") request.temperature = Number(temperature);
    const format = el.outputFormat.value;
    if (format === "json_object") request.response_format = { type: "json_object" };
    if (format === "json_schema") {
      // Sent as typed: a schema that is not JSON reaches the server as a string, and its
      // validation error names the field, as for any other bad input.
      let schema = el.jsonSchema.value;
      try { schema = JSON.parse(schema); } catch (_) { /* the server explains */ }
      request.response_format = { type: "json_schema", json_schema: { name: "page", schema } };
    }
    return request;
  }

  el.outputFormat.addEventListener("change", () => {
    const schema = el.outputFormat.value === "json_schema";
    el.jsonSchema.hidden = !schema;
    el.jsonSchemaLabel.hidden = !schema;
  });

  function socketUrl() {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/stream";
  }

  function submit() {
    if (job && !job.finished) return;
    resetAnswer();
    job = {
      id: null, token: null, lastId: 0, tokens: 0, finished: false,
      resumes: 0, progressed: false, socket: null,
    };
    el.send.disabled = true;
    setStatus("connecting");
    const frame = { type: "generate", request: buildRequest() };
    const key = apiKey();
    if (key) frame.api_key = key;
    connect(job, frame);
  }

  function connect(j, firstFrame) {
    const ws = new WebSocket(socketUrl());
    j.socket = ws;
    j.progressed = false;
    ws.onopen = () => ws.send(JSON.stringify(firstFrame));
    ws.onmessage = (message) => {
      if (j !== job || j.socket !== ws) return;
      let frame;
      try {
        frame = JSON.parse(message.data);
      } catch (_) {
        return;
      }
      if (frame && typeof frame === "object") onFrame(j, frame);
    };
    ws.onclose = (event) => {
      if (j === job && j.socket === ws) onClosed(j, event);
    };
  }

  function onFrame(j, f) {
    if (f.type === "pong") return;
    if (f.type === "accepted") {
      j.id = f.id;
      j.token = f.stream_token;
      el.jobId.textContent = f.id;
      setStatus("queued");
      return;
    }
    if (typeof f.id !== "number") {
      // Not a job event: the server refused the request or a frame ({"type": "error", ...}).
      if (f.type === "error") {
        const body = f.error && typeof f.error === "object" ? f.error : f;
        showError(body.message || body.type || "refused", body.fields, f.status);
        setStatus("error");
        finish(j);
      }
      return;
    }
    if (f.id <= j.lastId) return; // already shown (a resume never repeats, but be sure)
    j.lastId = f.id;
    j.progressed = true;
    switch (f.type) {
      case "queued":
        setStatus("queued", f.lane ? `queued · ${f.lane}` : "queued");
        break;
      case "started":
        setStatus("running");
        break;
      case "migrated":
        // Another worker continues the job where it was: what was shown stays.
        showNote(`The job moved to another worker and goes on (attempt ${f.attempt ?? "?"}).`);
        setStatus("running");
        break;
      case "token":
        appendOutput(typeof f.text === "string" ? f.text : "");
        // An event carries the tokens generated since the worker's last write: one or more.
        j.tokens += Array.isArray(f.token_ids) ? f.token_ids.length : 1;
        el.tokenCount.textContent = String(j.tokens);
        if (el.status.dataset.state !== "running") setStatus("running");
        break;
      case "restarted":
        // Another worker runs the job again from scratch: what was shown is void.
        clearOutput();
        j.tokens = 0;
        el.tokenCount.textContent = "0";
        showNote(`The job restarted on another worker (attempt ${f.attempt ?? "?"}).`);
        setStatus("restarted");
        break;
      case "done":
        el.finishReason.textContent = f.finish_reason || "–";
        el.usage.textContent = describeUsage(f.usage, f.timings);
        if (f.usage) el.tokenCount.textContent = String(f.usage.completion_tokens);
        setStatus("done");
        finish(j);
        break;
      case "error":
        showError(f.message || "the job failed", f.code ? [{ field: "code", reason: f.code }] : null);
        setStatus("error");
        finish(j);
        break;
      case "rejected":
        showError(f.message || `rejected: ${f.reason || "no reason given"}`,
                  f.reason ? [{ field: "reason", reason: f.reason }] : null);
        setStatus("rejected");
        finish(j);
        break;
      default:
        break; // an event type this page does not know yet
    }
  }

  function describeUsage(usage, timings) {
    if (!usage) return "–";
    let text = `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion` +
               ` = ${usage.total_tokens} tokens`;
    if (timings) {
      text += ` · first token ${Math.round(timings.ttft_ms)} ms` +
              ` · ${Number(timings.decode_tokens_per_s).toFixed(1)} tok/s`;
    }
    return text;
  }

  function onClosed(j, event) {
    if (j.finished) return;
    const why = `code ${event.code}${event.reason ? ": " + event.reason : ""}`;
    const refused = event.code >= 4400 && event.code < 4500; // resuming cannot help
    // Resume once after a drop; a resumed socket that brought new events earns another try.
    if (j.id && j.token && !refused && (j.resumes === 0 || j.progressed)) {
      j.resumes += 1;
      setStatus("resuming");
      showNote(`Connection dropped (${why}); resuming after event ${j.lastId}.`);
      const frame = { type: "resume", job_id: j.id, last_event_id: j.lastId, token: j.token };
      setTimeout(() => { if (j === job && !j.finished) connect(j, frame); }, RESUME_DELAY_MS);
      return;
    }
    if (j.id) {
      showError(`Lost the stream (${why}). The job may still finish: GET /v1/jobs/${j.id}`);
    } else {
      showError(`Could not submit: the connection closed (${why}).`);
    }
    setStatus("disconnected");
    finish(j);
  }

  function finish(j) {
    j.finished = true;
    el.send.disabled = false;
  }

  el.form.addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  el.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!el.send.disabled) el.form.requestSubmit();
    }
  });

  // ------------------------------------------------------------------ queue panel

  function cell(text, title) {
    const td = document.createElement("td");
    td.textContent = text;
    if (title) td.title = title;
    return td;
  }

  function placeholderRow(text) {
    const tr = document.createElement("tr");
    const td = cell(text);
    td.colSpan = 4;
    td.className = "muted";
    tr.append(td);
    return tr;
  }

  function seconds(s) {
    if (s === null || s === undefined) return "–";
    return s < 10 ? `${s.toFixed(1)} s` : `${Math.round(s)} s`;
  }

  function renderQueue(q) {
    const workers = Array.isArray(q.workers) ? q.workers : [];
    const lanes = Array.isArray(q.lanes) ? q.lanes : [];
    el.workers.textContent = String(workers.length);
    el.running.textContent = String(q.running ?? 0);
    el.tokensPerS.textContent = Number(q.tokens_per_s ?? 0).toFixed(1);
    noteServed(workers);
    const partitioned = lanes.some((l) => l.partition > 0);
    // Several models: each lane row names its model first.
    const models = new Set(lanes.map((l) => l.model)).size > 1;
    el.lanes.replaceChildren(...(lanes.length ? lanes.map((l) => {
      const tr = document.createElement("tr");
      // partition -1: the lane's jobs waiting on workers' own streams (prefix routing)
      const lane = l.partition < 0 ? `${l.lane} (routed)`
        : partitioned ? `${l.lane}/${l.partition}` : l.lane;
      tr.append(
        cell(models ? `${l.model} ${lane}` : lane, l.stream),
        cell(String(l.lag)), cell(String(l.pending)), cell(seconds(l.oldest_waiting_s)));
      return tr;
    }) : [placeholderRow("no lanes")]));
    el.workerList.replaceChildren(...(workers.length ? workers.map((w) => {
      const tr = document.createElement("tr");
      const id = String(w.worker_id);
      tr.append(
        cell(id.length > 18 ? id.slice(0, 17) + "…" : id, id),
        cell(w.waiting ? `${w.running} (+${w.waiting})` : String(w.running)),
        cell(Number(w.tokens_per_s).toFixed(1)),
        cell(`${Math.round(100 * Number(w.kv_usage))}%`));
      return tr;
    }) : [placeholderRow("no live workers")]));
    el.queue.dataset.state = "live";
    el.queueNote.textContent = "live";
  }

  function staleQueue(text) {
    el.queue.dataset.state = "stale";
    el.queueNote.textContent = text;
    for (const node of [el.workers, el.running, el.tokensPerS]) node.textContent = "–";
    el.lanes.replaceChildren(placeholderRow(text));
    el.workerList.replaceChildren();
  }

  async function pollQueue() {
    try {
      const response = await fetch("/v1/queue", { headers: authHeaders(), cache: "no-store" });
      if (response.status === 401) staleQueue("auth needed");
      else if (!response.ok) staleQueue(`unavailable (${response.status})`);
      else renderQueue(await response.json());
    } catch (_) {
      staleQueue("offline");
    } finally {
      setTimeout(pollQueue, QUEUE_EVERY_MS);
    }
  }

  // For tests and the curious: the job shown now (its socket, last event id, resumes).
  window.tidegate = { get job() { return job; } };

  loadModels();
  pollQueue();
  el.prompt.focus();
})();
