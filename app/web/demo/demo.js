// The demo page: one POST /predict per photo (so each photo gets its own answer, error and timings), to the
// model and version picked (filled from /v1/models: the server's default model at its default version first).
"use strict";

const $ = (id) => document.getElementById(id);
const keySection = $("key-section"), keyInput = $("key"), notice = $("notice"), results = $("results");
const modelPick = $("model-pick"), versionPick = $("version-pick");
let served = [];  // /v1/models's entries: one per loaded version

function headers() {
  const key = keyInput.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function errorText(status, body) {
  const error = body && body.error;
  if (error && typeof error === "object") {
    // The server numbers a request's images from 0 ("image 0 (cat.jpg): ..."); people count from 1.
    const index = error.details && error.details.image;
    const message = Number.isInteger(index) ? error.message.replace(/^image \d+/, `image ${index + 1}`)
                                            : error.message;
    return `${status} ${error.code}: ${message}`;
  }
  return `${status}: ${typeof error === "string" ? error : "the server answered without a JSON error"}`;
}

function needKey(message) {
  keySection.hidden = false;
  notice.textContent = message;
  keyInput.focus();
}

function defaultModel(body, names) {
  // The server's default model when it names one, else the only model, else the first listed.
  return names.includes(body.default_model) ? body.default_model : names[0];
}

function describeChoice() {
  const model = served.find((m) => m.name === modelPick.value && m.version === versionPick.value);
  $("model").textContent = model ? `${model.name} version ${model.version} · ${model.num_classes} classes · ` +
                                   `${model.device}` : "This server serves no model.";
}

function fillVersions() {
  const versions = served.filter((m) => m.name === modelPick.value);
  const option = (m) => new Option(`version ${m.version}` + (m.default ? " (default)" : ""), m.version,
                                   m.default, m.default);
  versionPick.replaceChildren(...versions.map(option));
  versionPick.disabled = versions.length === 0;
  describeChoice();
}

async function describeModels() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) return needKey("This server needs an API key: enter it above.");
    const body = await response.json();
    served = body.models;
    const names = [...new Set(served.map((m) => m.name))];
    const chosen = defaultModel(body, names);
    const option = (name) => new Option(name + (name === body.default_model ? " (default)" : ""), name,
                                        name === chosen, name === chosen);
    modelPick.replaceChildren(...names.map(option));
    modelPick.disabled = names.length === 0;
    fillVersions();
  } catch (err) {
    $("model").textContent = "The server did not answer: " + err;
  }
}

function predictUrl() {
  const query = new URLSearchParams();
  if (!modelPick.disabled) query.set("model", modelPick.value);
  if (!versionPick.disabled) query.set("version", versionPick.value);
  const topK = $("top-k").value.trim();
  if (topK) query.set("top_k", topK);
  const text = query.toString();
  return "/predict" + (text ? "?" + text : "");
}

function timings(header) {
  // Server-Timing: decode;dur=2.87, queue;dur=0.04, inference;dur=15.68, batch;desc="1"
  return (header || "").split(",").map((part) => {
    const [name, ...params] = part.trim().split(";");
    const dur = params.find((p) => p.startsWith("dur="));
    const desc = params.find((p) => p.startsWith("desc="));
    if (dur) return `${name} ${Number(dur.slice(4)).toFixed(1)} ms`;
    return desc ? `${name} ${desc.slice(5).replace(/"/g, "")}` : "";
  }).filter(Boolean).join(" · ");
}

function card(file) {
  const element = document.createElement("div");
  element.className = "card";
  const image = document.createElement("img");
  image.alt = file.name;
  image.src = URL.createObjectURL(file);
  image.onerror = () => image.remove();  // not an image the browser can show either: the error says why
  const name = document.createElement("div");
  name.className = "name";
  name.textContent = file.name;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = "Classifying…";
  element.append(image, name, body);
  results.append(element);  // in the order the photos were chosen
  return body;
}

function showPrediction(body, answer, response) {
  body.textContent = "";
  for (const entry of answer.predictions[0].top_k) {
    const row = document.createElement("div");
    row.className = "row";
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = entry.label;
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = (100 * entry.score).toFixed(1) + "%";
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.innerHTML = "<span></span>";
    bar.firstChild.style.width = (100 * entry.score).toFixed(1) + "%";
    row.append(label, score, bar);
    body.append(row);
  }
  const meta = document.createElement("div");
  meta.className = "meta";
  const answered = `${answer.model.name} version ${answer.model.version}`;
  meta.textContent = `${answered} · ${timings(response.headers.get("Server-Timing"))}`;
  body.append(meta);
}

async function classify(file) {
  const body = card(file);
  const form = new FormData();
  form.append("image", file, file.name);
  try {
    const response = await fetch(predictUrl(), { method: "POST", body: form, headers: headers() });
    let answer = null;
    try { answer = await response.json(); } catch (_) { /* not JSON: reported below */ }
    if (response.ok && answer) return showPrediction(body, answer, response);
    body.className = "body error";
    body.textContent = errorText(response.status, answer);
    if (response.status === 401) needKey("This server needs an API key: enter it above, then pick the photo again.");
  } catch (err) {
    body.className = "body error";
    body.textContent = "The request failed: " + err;
  }
}

function classifyAll(files) {
  notice.textContent = "";
  const names = Array.from(files, (file) => file.name);
  // The native input's own text would say "No file chosen" again (it is reset so the same photo can be picked
  // twice): this line says what was picked last.
  $("chosen").textContent = names.length === 0 ? "No photo chosen yet" :
    `${names.length} photo${names.length === 1 ? "" : "s"} chosen: ${names.join(", ")}`;
  for (const file of files) classify(file);
}

$("files").addEventListener("change", (event) => {
  classifyAll(event.target.files);
  event.target.value = "";  // picking the same photo again classifies it again
});
const drop = $("drop");
drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  classifyAll(event.dataTransfer.files);
});
modelPick.addEventListener("change", fillVersions);
versionPick.addEventListener("change", describeChoice);
keyInput.addEventListener("change", describeModels);
describeModels();
