// The demo page: one POST /predict per photo (so each photo gets its own answer, error and timings), to the
// model and version picked (filled from /v1/models: the server's default model at its default version first).
// While the model picked has a rollout candidate (canary or shadow) and no version is pinned, each photo goes to
// the live version and to the candidate, the two answers side by side, with the server's running comparison.
// Under an answer, "Why <label>?" asks POST /explain for the top class's Grad-CAM overlay and shows it beside the
// scores.
"use strict";

const $ = (id) => document.getElementById(id);
const keySection = $("key-section"), keyInput = $("key"), notice = $("notice"), results = $("results");
const modelPick = $("model-pick"), versionPick = $("version-pick"), rolloutLine = $("rollout");
const BOTH_VERSIONS = "";  // the version picker's value for "the live version and the candidate side by side"
let served = [];    // /v1/models's entries: one per loaded version
let rollouts = [];  // /v1/models's rollouts: one per model with a rollout (none from a server without them)
const RETRY_S = 2, RETRY_MAX_S = 30;  // asking /v1/models again: without a Retry-After, and at the latest
let modelsRetry = null;  // the timer that asks /v1/models again, while the server cannot answer it

function headers() {
  // The key as its UTF-8 bytes, one character each: fetch sends a header's characters as bytes (and refuses one
  // past U+00FF), so a key in any script reaches the server as curl would send it.
  const key = keyInput.value.trim();
  return key ? { Authorization: "Bearer " + String.fromCharCode(...new TextEncoder().encode(key)) } : {};
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

function rolloutPair(name) {
  // The live version and the candidate of model ``name`` (their /v1/models entries), when it has a rollout whose
  // candidate is loaded; else null.
  const rollout = rollouts.find((r) => r.model === name);
  if (!rollout || !rollout.candidate) return null;
  const entry = (version) => served.find((m) => m.name === name && m.version === version);
  const live = entry(rollout.live), candidate = entry(rollout.candidate);
  return live && candidate ? { rollout, live, candidate, role: candidate.role || "candidate" } : null;
}

function chosenPair() {
  // The pair to send each photo to: the model picked has a candidate and no version is pinned.
  return !versionPick.disabled && versionPick.value === BOTH_VERSIONS ? rolloutPair(modelPick.value) : null;
}

function comparisonText(pair) {
  const { rollout, role } = pair, comparison = rollout.comparison;
  const head = `Rollout: version ${rollout.candidate} (${role}) beside live version ${rollout.live}`;
  if (!comparison || !comparison.compared) {
    return `${head}; the server has compared no images` + (rollout.shadow_percent > 0 ? " yet." :
                                                           " (it compares only with a shadow share).");
  }
  const count = comparison.compared, agreement = (100 * comparison.top1_agreement).toFixed(1);
  const top = comparison.disagreements[0];
  const most = top ? `most frequent disagreement: live ${top.live}, candidate ${top.candidate} ` +
                     `(${top.count} image${top.count === 1 ? "" : "s"})` : "no disagreement";
  const images = `${count} image${count === 1 ? "" : "s"}`;
  return `${head}. The server compared ${images}: top-1 agreement ${agreement}%, ${most}.`;
}

function describeRollout() {
  // The server's running comparison for the model picked, while it has a candidate (pinned or not).
  const pair = rolloutPair(modelPick.value);
  rolloutLine.hidden = !pair;
  rolloutLine.textContent = pair ? comparisonText(pair) : "";
}

function describeChoice() {
  const pair = chosenPair();
  const model = pair ? pair.live : served.find((m) => m.name === modelPick.value && m.version === versionPick.value);
  const versions = pair ? `versions ${pair.live.version} (live) and ${pair.candidate.version} (${pair.role} candidate)`
                        : `version ${model && model.version}`;
  $("model").textContent = model ? `${model.name} ${versions} · ${model.num_classes} classes · ` +
                                   `${model.device}` : "This server serves no model.";
  describeRollout();
}

function versionOptions(name) {
  // What the version picker offers for model ``name``: with a candidate, both side by side first (picked), then
  // each version to pin; without, each version, its default picked.
  const pair = rolloutPair(name);
  const note = (m) => (m.default ? " (default)" : m.role === "canary" || m.role === "shadow" ?
                                                  ` (${m.role} candidate)` : "");
  const option = (m) => new Option(`version ${m.version}${note(m)}`, m.version, m.default && !pair, m.default && !pair);
  const both = pair ? [new Option(`${pair.live.version} (live) + ${pair.candidate.version} (${pair.role})`,
                                  BOTH_VERSIONS, true, true)] : [];
  return [...both, ...served.filter((m) => m.name === name).map(option)];
}

function fillVersions() {
  const options = versionOptions(modelPick.value);
  versionPick.replaceChildren(...options);
  versionPick.disabled = options.length === 0;
  describeChoice();
}

function offered(name) {
  // The version picker's choices for ``name`` as text: the picker is filled again only when they change.
  return versionOptions(name).map((o) => `${o.value}=${o.text}`).join("\n");
}

async function refreshRollouts() {
  // The server's comparison moves with its traffic (this page's requests name their version, so the shadow does
  // not run on them): read /v1/models again after each pair of answers.
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) return;
    const body = await response.json(), before = offered(modelPick.value);
    [served, rollouts] = [body.models, body.rollouts || []];
    if (offered(modelPick.value) !== before) return fillVersions();  // promoted or rolled back meanwhile
    describeRollout();
  } catch (_) { /* the line keeps its last figures */ }
}

function retryModels(status, retryAfter) {
  // Whether the page asks /v1/models again, and when (the server's Retry-After, else RETRY_S): while it cannot
  // answer yet (503 while its models load, 429, any 5xx) or did not answer at all (status null). Returns the note
  // the model line ends with.
  if (status !== null && status !== 429 && status < 500) return "";
  const seconds = Math.min(Math.max(Number.parseInt(retryAfter, 10) || RETRY_S, 1), RETRY_MAX_S);
  modelsRetry = setTimeout(describeModels, seconds * 1000);
  return ` · asking again in ${seconds} s`;
}

async function describeModels() {
  // The models the server serves, into the pickers; while it cannot say (its models loading), why, until it can.
  clearTimeout(modelsRetry);
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) return needKey("This server needs an API key: enter it above.");
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON: reported as it is */ }
    if (!response.ok || !body || !Array.isArray(body.models)) {
      const again = retryModels(response.status, response.headers.get("Retry-After"));
      $("model").textContent = errorText(response.status, body) + again;
      return;
    }
    [served, rollouts] = [body.models, body.rollouts || []];
    const names = [...new Set(served.map((m) => m.name))];
    const chosen = defaultModel(body, names);
    const option = (name) => new Option(name + (name === body.default_model ? " (default)" : ""), name,
                                        name === chosen, name === chosen);
    modelPick.replaceChildren(...names.map(option));
    modelPick.disabled = names.length === 0;
    fillVersions();
  } catch (err) {
    $("model").textContent = "The server did not answer: " + err + retryModels(null, null);
  }
}

function explainUrl(version, index) {
  // /explain of class ``index`` by the model picked at ``version`` (null: none named), as a PNG overlay.
  const query = new URLSearchParams({ format: "png", class_index: String(index) });
  if (!modelPick.disabled) query.set("model", modelPick.value);
  if (version !== null) query.set("version", version);
  return "/explain?" + query.toString();
}

async function explainInto(holder, button, file, version, top) {
  // The photo's Grad-CAM overlay for class ``top`` in ``holder``, or the server's error (e.g. a version with no
  // gradients to explain with).
  button.disabled = true;
  holder.textContent = "Explaining…";
  const form = new FormData();
  form.append("image", file, file.name);
  try {
    const response = await fetch(explainUrl(version, top.index), { method: "POST", body: form, headers: headers() });
    if (!response.ok) {
      let answer = null;
      try { answer = await response.json(); } catch (_) { /* not JSON: reported as it is */ }
      holder.className = "explanation error";
      holder.textContent = errorText(response.status, answer);
      button.disabled = false;
      return;
    }
    const overlay = document.createElement("img");
    overlay.className = "overlay";
    overlay.alt = `Where the model sees ${top.label}`;
    overlay.src = URL.createObjectURL(await response.blob());
    const caption = document.createElement("div");
    caption.className = "meta";
    caption.textContent = `Grad-CAM: the brighter, the more this region made it say ${top.label}.`;
    holder.replaceChildren(overlay, caption);
    button.remove();
  } catch (err) {
    holder.className = "explanation error";
    holder.textContent = "The request failed: " + err;
    button.disabled = false;
  }
}

function predictUrl(version) {
  // /predict for the model picked at ``version`` (null: none named).
  const query = new URLSearchParams();
  if (!modelPick.disabled) query.set("model", modelPick.value);
  if (version !== null) query.set("version", version);
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

function offerExplanation(body, file, version, top) {
  // A "Why <label>?" button under the answer; the overlay goes beside the scores.
  const holder = document.createElement("div");
  holder.className = "explanation";
  const button = document.createElement("button");
  button.type = "button";
  button.className = "why";
  button.textContent = `Why ${top.label}?`;
  button.addEventListener("click", () => explainInto(holder, button, file, version, top));
  body.append(button, holder);
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

async function answerInto(body, file, version) {
  // POST ``file`` to ``version`` (null: none named) and show the answer, or the error, in ``body``; returns the
  // answer shown, or null for an error.
  const form = new FormData();
  form.append("image", file, file.name);
  try {
    const response = await fetch(predictUrl(version), { method: "POST", body: form, headers: headers() });
    let answer = null;
    try { answer = await response.json(); } catch (_) { /* not JSON: reported below */ }
    if (response.ok && answer) {
      showPrediction(body, answer, response);
      offerExplanation(body, file, version, answer.predictions[0]);
      return answer;
    }
    body.className = "body error";
    body.textContent = errorText(response.status, answer);
    if (response.status === 401) needKey("This server needs an API key: enter it above, then pick the photo again.");
  } catch (err) {
    body.className = "body error";
    body.textContent = "The request failed: " + err;
  }
  return null;
}

function side(title) {
  // One version's half of a compared card: its heading, and where its answer goes.
  const section = document.createElement("section");
  section.className = "side";
  const heading = document.createElement("h2");
  heading.textContent = title;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = "Classifying…";
  section.append(heading, body);
  return { section, body };
}

function verdict(pair, live, candidate) {
  // Whether the two answers' top-1 agrees: {text, kind} (kind: agree, differ, or error when one has no answer).
  if (!live || !candidate) {
    const missing = !live && !candidate ? "neither version answered" : !live ? "the live version did not answer"
                                                                             : "the candidate did not answer";
    return { text: `Top-1 not compared: ${missing}.`, kind: "error" };
  }
  const [ours, theirs] = [live.predictions[0], candidate.predictions[0]];
  if (ours.index === theirs.index) return { text: `Top-1 agrees: both versions say ${ours.label}.`, kind: "agree" };
  return { text: `Top-1 differs: live version ${pair.live.version} says ${ours.label}, ` +
                 `candidate version ${pair.candidate.version} says ${theirs.label}.`, kind: "differ" };
}

async function classifyBoth(file, pair) {
  // The photo to the live version and to the candidate at once, their answers side by side and whether their
  // top-1 agrees.
  const body = card(file);
  body.closest(".card").classList.add("compared");
  const live = side(`Live · version ${pair.live.version}`);
  const candidate = side(`Candidate (${pair.role}) · version ${pair.candidate.version}`);
  const sides = document.createElement("div");
  sides.className = "sides";
  sides.append(live.section, candidate.section);
  const line = document.createElement("p");
  line.className = "verdict";
  line.setAttribute("aria-live", "polite");  // in the page before its text, so the text is announced
  body.replaceChildren(sides, line);
  const answers = await Promise.all([answerInto(live.body, file, pair.live.version),
                                     answerInto(candidate.body, file, pair.candidate.version)]);
  const { text, kind } = verdict(pair, ...answers);
  line.textContent = text;
  line.classList.add(kind);
  refreshRollouts();
}

function classify(file) {
  const pair = chosenPair();
  if (pair) return classifyBoth(file, pair);
  return answerInto(card(file), file, versionPick.disabled ? null : versionPick.value);
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
