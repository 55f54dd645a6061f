// The page: a client of this server's API like any other (docs/SERVING.md). No framework, nothing
// fetched from elsewhere. Form from GET /v1/models; POST /v1/images/generations (or /v1/images/edits)
// with "stream": true, read as server-sent events; Cancel closes the stream (the server stops the
// image at the next denoising step). Errors from the server land beside the field their `param` names.
"use strict";

const KEY_STORE = "hunyuan-api-key";
const $ = (id) => document.getElementById(id);
const FIELD_ERRORS = {prompt: "prompt", size: "size", steps: "steps", seed: "seed", bot_task: "bot_task",
                      step_cache: "step_cache", image: "image", model: "model", adapter: "model"};
const FIELD_INPUTS = {prompt: "prompt", size: "size", steps: "steps", seed: "seed", bot_task: "bot-task",
                      step_cache: "step-cache", image: "images", model: "adapter", adapter: "adapter"};
let capabilities = null;
let running = null;            // {controller, started} while a request is on its way

function apiKey() { return sessionStorage.getItem(KEY_STORE); }

function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return fetch(path, Object.assign({}, options, {headers}));
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error || {message: response.status + " " + response.statusText};
  } catch (e) {
    return {message: response.status + " " + response.statusText};
  }
}

// ------------------------------------------------------------------ the key, asked once per tab

function askKey(message) {
  $("app").hidden = true;
  $("key-form").hidden = false;
  $("err-key").textContent = message || "";
  $("api-key").value = "";
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) { $("err-key").textContent = "api key: empty; paste the key the server was started with"; return; }
  sessionStorage.setItem(KEY_STORE, key);
  load();
});

$("forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY_STORE); askKey(""); });

// ------------------------------------------------------------------ the form, from the model's capabilities

function fillSelect(select, values, chosen) {
  select.replaceChildren(...values.map((value) => {
    const option = document.createElement("option");
    option.value = option.textContent = value;
    option.selected = value === chosen;
    return option;
  }));
}

async function load() {
  $("err-load").textContent = "";
  let response;
  try {
    response = await api("/v1/models");
  } catch (e) {
    $("err-load").textContent = "cannot reach the server: " + e.message;
    return;
  }
  if (response.status === 401) {
    const error = await errorOf(response);
    askKey(apiKey() ? error.message : "");
    return;
  }
  if (!response.ok) { $("err-load").textContent = (await errorOf(response)).message; return; }
  const cards = (await response.json()).data;
  const card = cards[0];
  capabilities = card.capabilities;
  $("model-name").textContent = card.id;
  const adapters = cards.filter(c => c.parent === card.id).map(c => c.id);      // --lora-modules
  $("adapter-field").hidden = adapters.length === 0;
  fillSelect($("adapter"), ["", ...adapters], "");
  if ($("adapter").options.length) $("adapter").options[0].textContent = "none (the base weights)";
  fillSelect($("size"), capabilities.sizes, capabilities.default_size);
  fillSelect($("bot-task"), capabilities.bot_tasks, capabilities.default_bot_task);
  fillSelect($("step-cache"), capabilities.step_cache, capabilities.default_step_cache);
  $("steps").value = String(capabilities.steps.default);
  $("steps").title = `${capabilities.steps.min} to ${capabilities.steps.max}`;
  $("seed").title = `random, or ${capabilities.seed.min} to ${capabilities.seed.max}`;
  const images = capabilities.conditioning_images;
  $("images-field").hidden = !images;
  $("images-max").textContent = images ? `1 to ${images}` : "";
  $("key-form").hidden = true;
  $("forget-key").hidden = !apiKey();
  $("app").hidden = false;
  $("prompt").focus();
}

// ------------------------------------------------------------------ errors beside their fields

function clearErrors() {
  for (const id of Object.values(FIELD_ERRORS)) $("err-" + id).textContent = "";
  $("err-general").textContent = "";
  for (const id of Object.values(FIELD_INPUTS)) $(id).removeAttribute("aria-invalid");
}

function showError(error) {
  const param = (error.param || "").split(/[.[]/)[0];
  const field = FIELD_ERRORS[param];
  if (!field) { $("err-general").textContent = error.message; return; }
  $("err-" + field).textContent = error.message;
  const input = $(FIELD_INPUTS[param]);
  input.setAttribute("aria-invalid", "true");
  input.focus();
}

// ------------------------------------------------------------------ one request

function typed(text) {          // a number when it reads as one; else as typed, for the server to name
  const trimmed = text.trim();
  return /^-?[0-9]+$/.test(trimmed) ? Number(trimmed) : text;
}

function settings() {
  const body = {prompt: $("prompt").value, size: $("size").value, bot_task: $("bot-task").value,
                step_cache: $("step-cache").value};
  if ($("adapter").value) body.model = $("adapter").value;
  if ($("steps").value.trim() !== "") body.steps = typed($("steps").value);
  const seed = $("seed").value.trim();
  if (seed !== "" && seed.toLowerCase() !== "random") body.seed = typed(seed);
  return body;
}

function requestOf(body) {
  const files = $("images-field").hidden ? [] : Array.from($("images").files);
  if (!files.length) {
    return ["/v1/images/generations", {method: "POST", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify(Object.assign({stream: true}, body))}];
  }
  const form = new FormData();
  for (const [name, value] of Object.entries(body)) form.append(name, String(value));
  form.append("stream", "true");
  for (const file of files) form.append("image[]", file, file.name);
  return ["/v1/images/edits", {method: "POST", body: form}];
}

function status(text, step, steps) {
  $("status-text").textContent = text;
  $("progress").hidden = steps === undefined;
  if (steps !== undefined) { $("progress").max = steps; $("progress").value = step; }
}

function ordinal(n) {
  const suffix = ["th", "st", "nd", "rd"], tens = n % 100;
  return n + (suffix[(tens - 20) % 10] || suffix[tens] || suffix[0]);
}

function onEvent(name, data) {
  if (name === "queued") {
    status(`Waiting: ${ordinal(data.position)} in line (${data.queue_depth} waiting)`);
  } else if (name === "progress") {
    const image = data.images > 1 ? `image ${data.image} of ${data.images}: ` : "";
    if (data.step === 0) status(`${image}starting (text phase, then denoising)`, 0, data.steps);
    else if (data.step < data.steps) status(`${image}denoising step ${data.step} of ${data.steps}`, data.step, data.steps);
    else status(`${image}denoised ${data.steps} steps; decoding`, data.steps, data.steps);
  }
}

async function readEvents(response, handle) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) handle(name, JSON.parse(data));
    }
  }
}

async function generate() {
  if (running) return;
  clearErrors();
  const body = settings();
  const [path, options] = requestOf(body);
  const controller = new AbortController();
  running = {controller, started: performance.now()};
  $("generate").disabled = true;
  $("cancel").disabled = false;
  status("Sending…");
  let outcome = null;
  try {
    const response = await api(path, Object.assign(options, {signal: controller.signal}));
    if (response.status === 401) { askKey((await errorOf(response)).message); return; }
    if (!response.ok) { showError(await errorOf(response)); status(""); return; }
    const images = [];
    await readEvents(response, (name, data) => {
      if (name.endsWith(".completed")) images.push(data);      // OpenAI's event: one per image, the image in it
      else if (name === "error") outcome = data;
      else onEvent(name, data);
    });
    if (outcome) { showError(outcome.error); status(""); return; }
    if (!images.length) { status("The server closed the stream without an answer"); return; }
    const seconds = (performance.now() - running.started) / 1000;
    images.forEach((item) => showResult(item, body, item.seconds, seconds));
    status(`Done in ${seconds.toFixed(1)} s`);
  } catch (e) {
    status(e.name === "AbortError" ? "Cancelled" : "Request failed: " + e.message);
  } finally {
    running = null;
    $("generate").disabled = false;
    $("cancel").disabled = true;
  }
}

function cancel() {
  if (running) running.controller.abort();
}

// ------------------------------------------------------------------ results and the session's gallery

function describe(item, body) {
  return {prompt: body.prompt, size: item.size, steps: body.steps ?? capabilities.steps.default, seed: item.seed,
          bot_task: body.bot_task, step_cache: body.step_cache, model: $("model-name").textContent};
}

function showResult(item, body, serverSeconds, pageSeconds) {
  const settingsOf = describe(item, body);
  const png = pngWithSettings(item.b64_json, settingsOf);
  const url = URL.createObjectURL(new Blob([png], {type: "image/png"}));
  const name = `hunyuan_${item.seed}_${slug(body.prompt)}.png`;
  $("result").hidden = false;
  $("result-image").src = "data:image/png;base64," + item.b64_json;
  $("result-image").alt = body.prompt;
  const rows = [["seed", item.seed], ["size", item.size], ["steps", settingsOf.steps], ["bot task", body.bot_task],
                ["step cache", body.step_cache], ["server time", `${serverSeconds} s (queue + run)`],
                ["page time", `${pageSeconds.toFixed(1)} s`]];
  $("result-info").replaceChildren(...rows.flatMap(([term, value]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = String(value);
    return [dt, dd];
  }));
  $("result-text").hidden = !item.text;
  $("result-text").textContent = item.text || "";
  $("result-download").href = url;
  $("result-download").download = name;
  addToGallery(item, settingsOf, url, name);
}

function addToGallery(item, settingsOf, url, name) {
  const li = document.createElement("li");
  const thumb = document.createElement("button");
  thumb.type = "button";
  thumb.className = "thumb";
  thumb.title = "Show it large";
  const img = document.createElement("img");
  img.src = "data:image/png;base64," + item.b64_json;
  img.alt = settingsOf.prompt;
  thumb.append(img);
  thumb.addEventListener("click", () => {
    $("result-image").src = img.src;
    $("result-download").href = url;
    $("result-download").download = name;
  });
  const caption = document.createElement("p");
  caption.textContent = `${settingsOf.prompt.slice(0, 60)} · seed ${item.seed} · ${item.size} · ${settingsOf.steps} steps`;
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  link.textContent = "PNG";
  const json = document.createElement("a");
  json.href = URL.createObjectURL(new Blob([JSON.stringify(settingsOf, null, 2)], {type: "application/json"}));
  json.download = name.replace(/\.png$/, ".json");
  json.textContent = "settings";
  li.append(thumb, caption, link, " · ", json);
  $("gallery").prepend(li);
  $("gallery-section").hidden = false;
}

function slug(text) { return (text.toLowerCase().match(/[a-z0-9]+/g) || ["image"]).slice(0, 6).join("-").slice(0, 60); }

// A PNG carrying its settings: an iTXt chunk "parameters" (UTF-8 JSON) right after IHDR.
const CRC_TABLE = Array.from({length: 256}, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

function crc32(bytes) {
  let c = 0xffffffff;
  for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

function pngWithSettings(b64, settingsOf) {
  const png = Uint8Array.from(atob(b64), (ch) => ch.charCodeAt(0));
  const encoder = new TextEncoder();
  const data = [...encoder.encode("parameters"), 0, 0, 0, 0, 0, ...encoder.encode(JSON.stringify(settingsOf))];
  const typeAndData = Uint8Array.from([...encoder.encode("iTXt"), ...data]);
  const chunk = new Uint8Array(12 + data.length);
  const view = new DataView(chunk.buffer);
  view.setUint32(0, data.length);
  chunk.set(typeAndData, 4);
  view.setUint32(8 + data.length, crc32(typeAndData));
  const ihdrEnd = 8 + 25;                      // signature, then IHDR (13 data bytes + 12)
  const out = new Uint8Array(png.length + chunk.length);
  out.set(png.subarray(0, ihdrEnd), 0);
  out.set(chunk, ihdrEnd);
  out.set(png.subarray(ihdrEnd), ihdrEnd + chunk.length);
  return out;
}

// ------------------------------------------------------------------ keyboard

$("gen-form").addEventListener("submit", (event) => { event.preventDefault(); generate(); });
$("cancel").addEventListener("click", cancel);
$("seed-random").addEventListener("click", () => { $("seed").value = "random"; $("seed").focus(); });
document.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); generate(); }
  if (event.key === "Escape" && running) { event.preventDefault(); cancel(); }
});

load();
