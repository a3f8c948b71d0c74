// The demo page: one POST /predict per photo (so each photo gets its own answer, error and timings).
"use strict";

const $ = (id) => document.getElementById(id);
const keySection = $("key-section"), keyInput = $("key"), notice = $("notice"), results = $("results");

function headers() {
  const key = keyInput.value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function errorText(status, body) {
  const error = body && body.error;
  if (error && typeof error === "object") return `${status} ${error.code}: ${error.message}`;
  return `${status}: ${typeof error === "string" ? error : "the server answered without a JSON error"}`;
}

function needKey(message) {
  keySection.hidden = false;
  notice.textContent = message;
  keyInput.focus();
}

async function describeModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) return needKey("This server needs an API key: enter it above.");
    const body = await response.json();
    const model = body.models[0];
    $("model").textContent = `${model.name} ${model.version} · ${model.num_classes} classes · ${model.device}`;
  } catch (err) {
    $("model").textContent = "The server did not answer: " + err;
  }
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
  results.prepend(element);
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
  meta.textContent = `${answer.model.name} ${answer.model.version} · ${timings(response.headers.get("Server-Timing"))}`;
  body.append(meta);
}

async function classify(file) {
  const body = card(file);
  const form = new FormData();
  form.append("image", file, file.name);
  const topK = $("top-k").value.trim();
  try {
    const response = await fetch("/predict" + (topK ? `?top_k=${encodeURIComponent(topK)}` : ""),
                                 { method: "POST", body: form, headers: headers() });
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
keyInput.addEventListener("change", describeModel);
describeModel();
