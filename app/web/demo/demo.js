// The demo page: one POST /predict per photo (so each photo gets its own answer, error and timings), to the
// model and version picked (filled from /v1/models: the server's default model at its default version first).
// While the model picked has a rollout candidate (canary or shadow) and no version is pinned, each photo goes to
// the live version and to the candidate, the two answers side by side, with the server's running comparison.
// Under an answer, "Why <label>?" asks POST /explain for the top class's Grad-CAM overlay and shows it beside the
// scores. A photo names a version only when one other than the model's default is picked, so the page goes on working
// when the server swaps in a new version; a version gone meanwhile (404) reads the models again and asks once more.
"use strict";

const $ = (id) => document.getElementById(id);
const keySection = $("key-section"), keyInput = $("key"), notice = $("notice"), results = $("results");
const modelPick = $("model-pick"), versionPick = $("version-pick"), rolloutLine = $("rollout");
const BOTH_VERSIONS = "";  // the version picker's value for "the live version and the candidate side by side"
let served = [];    // /v1/models's entries: one per loaded version
let rollouts = [];  // /v1/models's rollouts: one per model with a rollout (none from a server without them)
const RETRY_S = 2, RETRY_MAX_S = 30;  // asking /v1/models again: without a Retry-After, and at the latest
let modelsRetry = null;  // the timer that asks /v1/models again, while the server cannot answer it
let modelsReading = null;  // the read of /v1/models under way (readModels), which others asking then share
const SEND_RETRY_MAX_S = 5;  // a photo or explanation is sent again after a 429 or 503 asking to wait this long or less
let keyUsed = null;  // the key box's value the last request was sent with

function headers() {
  // The key as its UTF-8 bytes, one character each: fetch sends a header's characters as bytes (and refuses one
  // past U+00FF), so a key in any script reaches the server as curl would send it.
  const key = keyInput.value.trim();
  keyUsed = key;
  return key ? { Authorization: "Bearer " + String.fromCharCode(...new TextEncoder().encode(key)) } : {};
}

function errorText(status, body) {
  const error = body && body.error;
  if (error && typeof error === "object") {
    // The server names the image within its request ("image 0 (cat.jpg): ..."): the page sends one photo a
    // request, whose card names it already (an index there, 0 or 1, counted nothing a person chose).
    // (the name as the message gives it: a long one shortened there, "start…end")
    const details = error.details || {};
    const prefix = Number.isInteger(details.image) ? new RegExp(`^image ${details.image}(?: \\(.*?\\))?: `) : null;
    const message = prefix ? error.message.replace(prefix, "") : error.message;
    return `${status} ${error.code}: ${message}`;
  }
  return `${status}: ${typeof error === "string" ? error : "the server answered without a JSON error"}`;
}

function retryAfterS(response) {
  // The response's Retry-After in whole seconds (delay-seconds or an HTTP date), or null without one.
  const value = (response.headers.get("Retry-After") || "").trim();
  if (/^\d+(\.\d+)?$/.test(value)) return Math.ceil(Number(value));
  const when = value ? Date.parse(value) : Number.NaN;
  return Number.isNaN(when) ? null : Math.max(0, Math.ceil((when - Date.now()) / 1000));
}

function failureText(result) {
  // A request's error as the page shows it, with when to try again when the server said so.
  const { response, error } = result, wait = retryAfterS(response);
  return errorText(response.status, error) + (wait ? ` · try again in ${wait} s` : "");
}

let keyNoticeShown = false;  // the notice says the key is missing or refused (cleared once a key is taken)

function needKey(keySent, then, focus = true) {
  // The key box, and why: the server refused the key sent, or none was sent. ``then``: what to do once it is in.
  // The focus goes to the box unless the key was checked as the box was left (Tab, a click elsewhere): it is not
  // taken back from where the person went. The notice is written only when it changes: a status read out again
  // and again says nothing new.
  keySection.hidden = false;
  const text = keySent ? `The server refused this API key: check it and enter it again above${then}.`
                       : `This server needs an API key: enter it above${then}.`;
  if (notice.textContent !== text) {
    notice.textContent = text;
  } else if (keyNoticeShown && keySent) {  // another key refused in the same words: said again, not silence
    notice.textContent = "";
    setTimeout(() => { notice.textContent = text; }, 100);
  }
  keyNoticeShown = true;
  if (focus) keyInput.focus();
}

function keyChanged() {
  // The models read again with the key now in the box, when it is not the one the last request was sent with: as
  // the box is left or Enter pressed in it. Never while it is typed: each pause sent a part of the key, and each
  // refusal took the focus back (an accessibility trial). Photos dropped meanwhile are sent with the key as it is.
  if (keyInput.value.trim() !== keyUsed) readModels(true);
}

function keyTaken() {
  // A call with the key was answered: a notice that it is missing or refused no longer holds.
  if (keyNoticeShown) notice.textContent = "";
  keyNoticeShown = false;
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
  const text = pair ? comparisonText(pair) : "";
  if (rolloutLine.textContent !== text) rolloutLine.textContent = text;  // a live region: read when it changes
}

function sayModel(text) {
  // The model line: a status, read out when it changes (the models chosen, or why they cannot show: loading, no
  // answer, the key); written only then, so an unchanged "asking again" is not read out again.
  const line = $("model");
  if (line.textContent !== text) line.textContent = text;
}

function describeChoice() {
  const pair = chosenPair();
  const model = pair ? pair.live : served.find((m) => m.name === modelPick.value && m.version === versionPick.value);
  const versions = pair ? `versions ${pair.live.version} (live) and ${pair.candidate.version} (${pair.role} candidate)`
                        : `version ${model && model.version}`;
  sayModel(model ? `${model.name} ${versions} · ${model.num_classes} classes · ${model.device}`
                 : "This server serves no model.");
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

function fillVersions(keep = null) {
  // The version picker for the model picked; ``keep``, a version pinned before, stays picked while it is offered.
  const options = versionOptions(modelPick.value);
  versionPick.replaceChildren(...options);
  versionPick.disabled = options.length === 0;
  if (keep !== null && options.some((o) => o.value === keep)) versionPick.value = keep;
  describeChoice();
}

function pinnedVersion() {
  // The version a photo names: the one picked, unless it is the model's default version or both side by side are
  // picked (null: none named, so the server answers with its default version, whichever that is by then).
  if (versionPick.disabled || versionPick.value === BOTH_VERSIONS) return null;
  const entry = served.find((m) => m.name === modelPick.value && m.version === versionPick.value);
  return entry && entry.default ? null : versionPick.value;
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
    const body = await response.json(), before = offered(modelPick.value), pinned = pinnedVersion();
    [served, rollouts] = [body.models, body.rollouts || []];
    if (offered(modelPick.value) !== before) return fillVersions(pinned);  // promoted or rolled back meanwhile
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

async function describeModels(fromKey = false) {
  // The models the server serves, into the pickers; while it cannot say (its models loading), why, until it can.
  // The model and the version picked stay picked while they are served. ``fromKey``: read for a key just entered.
  clearTimeout(modelsRetry);
  try {
    const auth = headers();
    const response = await fetch("/v1/models", { headers: auth });
    if (response.status === 401) {
      sayModel("The models show once the server takes the API key.");
      return needKey("Authorization" in auth, "", !fromKey);
    }
    keyTaken();
    let body = null;
    try { body = await response.json(); } catch (_) { /* not JSON: reported as it is */ }
    if (!response.ok || !body || !Array.isArray(body.models)) {
      const again = retryModels(response.status, response.headers.get("Retry-After"));
      sayModel(errorText(response.status, body) + again);
      return;
    }
    const before = modelPick.disabled ? null : modelPick.value, pinned = pinnedVersion();
    [served, rollouts] = [body.models, body.rollouts || []];
    const names = [...new Set(served.map((m) => m.name))];
    const chosen = names.includes(before) ? before : defaultModel(body, names);
    const option = (name) => new Option(name + (name === body.default_model ? " (default)" : ""), name,
                                        name === chosen, name === chosen);
    modelPick.replaceChildren(...names.map(option));
    modelPick.disabled = names.length === 0;
    fillVersions(chosen === before ? pinned : null);
  } catch (err) {
    sayModel("The server did not answer: " + err + retryModels(null, null));
  }
}

function readModels(fromKey = false) {
  // describeModels, once for all who ask while it runs (several photos told 404 at once read the models once).
  modelsReading = modelsReading || describeModels(fromKey).finally(() => { modelsReading = null; });
  return modelsReading;
}

async function post(url, file, note) {
  // POST ``file`` to url() (asked again for each try). Once more after a 404 not_found, the models read again first
  // (a version swapped or unloaded since the page read them: url() then names what the pickers say now), and once
  // more after a 429 or 503 whose Retry-After is at most SEND_RETRY_MAX_S, ``note`` saying so meanwhile. Returns
  // {response, error: its JSON body when not ok, keySent}.
  const doing = note.textContent;  // "Classifying…": said on while it waits
  let reread = false, waited = false;
  for (;;) {
    const form = new FormData();
    form.append("image", file, file.name);
    const auth = headers();
    const response = await fetch(url(), { method: "POST", body: form, headers: auth });
    let error = null;
    if (!response.ok) {
      try { error = await response.json(); } catch (_) { /* not JSON: reported as it is */ }
    }
    const result = { response, error, keySent: "Authorization" in auth };
    if (response.status === 404 && error && error.error && error.error.code === "not_found" && !reread) {
      reread = true;
      await readModels();
      continue;
    }
    const wait = retryAfterS(response);
    if ((response.status === 429 || response.status === 503) && wait !== null && wait <= SEND_RETRY_MAX_S && !waited) {
      waited = true;
      note.textContent = `${doing} ${errorText(response.status, error)} · trying again in ${wait} s`;
      await new Promise((resolve) => setTimeout(resolve, wait * 1000));
      continue;
    }
    return result;
  }
}

function explainUrl(target, index) {
  // /explain of class ``index`` by ``target`` ({model, version}, each null: none named), as a PNG overlay.
  const query = new URLSearchParams({ format: "png", class_index: String(index) });
  if (target.model !== null) query.set("model", target.model);
  if (target.version !== null) query.set("version", target.version);
  return "/explain?" + query.toString();
}

function showOverlay(holder, blob, top) {
  const overlay = document.createElement("img");
  overlay.className = "overlay";
  overlay.alt = `Where the model sees ${top.label}`;
  const url = URL.createObjectURL(blob);
  overlay.onload = overlay.onerror = () => URL.revokeObjectURL(url);  // shown (or not an image): the blob can go
  overlay.src = url;
  const caption = document.createElement("div");
  caption.className = "meta";
  caption.textContent = `Grad-CAM: the brighter, the more this region made it say ${top.label}.`;
  holder.replaceChildren(overlay, caption);
}

async function explainInto(holder, button, file, target, top) {
  // The photo's Grad-CAM overlay for class ``top`` in ``holder``, or the server's error (e.g. a version with no
  // gradients to explain with). The button goes once the overlay is shown; focus on it moves to the overlay's
  // holder first (else it would fall to the page's start), and comes back to it after an error.
  const focused = () => document.activeElement === button || document.activeElement === document.body;
  const hadFocus = document.activeElement === button;
  button.disabled = true;
  holder.className = "explanation";
  holder.textContent = "Explaining…";
  try {
    const result = await post(() => explainUrl(target, top.index), file, holder);
    if (result.response.ok) {
      showOverlay(holder, await result.response.blob(), top);
      if (hadFocus && focused()) holder.focus();
      button.remove();
      return;
    }
    holder.className = "explanation error";
    holder.textContent = failureText(result);
    if (result.response.status === 401) needKey(result.keySent, ", then ask again");
  } catch (err) {
    holder.className = "explanation error";
    holder.textContent = "The request failed: " + err;
  }
  button.disabled = false;
  if (hadFocus && focused()) button.focus();
}

function predictUrl(target) {
  // /predict for ``target`` ({model, version}, each null: none named).
  const query = new URLSearchParams();
  if (target.model !== null) query.set("model", target.model);
  if (target.version !== null) query.set("version", target.version);
  const topK = $("top-k").value.trim();
  if (topK) query.set("top_k", topK);
  const text = query.toString();
  return "/predict" + (text ? "?" + text : "");
}

function timings(header) {
  // Server-Timing: wait;dur=0.05, decode;dur=2.87, queue;dur=0.04, inference;dur=15.68, batch;desc="1"
  return (header || "").split(",").map((part) => {
    const [name, ...params] = part.trim().split(";");
    const dur = params.find((p) => p.startsWith("dur="));
    const desc = params.find((p) => p.startsWith("desc="));
    if (dur) return `${name} ${Number(dur.slice(4)).toFixed(1)} ms`;
    return desc ? `${name} ${desc.slice(5).replace(/"/g, "")}` : "";
  }).filter(Boolean).join(" · ");
}

function answerRegion(title, heading, photo = null) {
  // A live region holding a heading (``title``, as a ``heading`` element) and the body an answer goes into: read
  // whole when the body changes (aria-atomic), so an answer or an error is heard with what it answers (several
  // photos' answers come in any order). Returns {region, body}.
  const region = document.createElement("div");
  region.setAttribute("aria-live", "polite");  // in the page before its answer, so the answer is announced
  region.setAttribute("aria-atomic", "true");
  const named = document.createElement(heading);
  named.className = "name";
  named.textContent = title;
  if (photo !== null) {  // a rollout's side: heard with the photo it answers (its name is the card's heading)
    const said = document.createElement("span");
    said.className = "visually-hidden";
    said.textContent = `${photo}: `;
    named.prepend(said);
  }
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = "Classifying…";
  region.append(named, body);
  return { region, body };
}

function answerHolder(body) {
  // The card or the rollout side whose answer ``body`` holds: what goes beside the answer (its timings, the "Why"
  // button and the explanation) goes there, after the live region, not read out with each answer.
  return body.parentElement.parentElement;
}

function card(file) {
  const element = document.createElement("article");
  element.className = "card";
  const image = document.createElement("img");
  image.alt = "";  // the photo's name is the card's heading, right below
  const url = URL.createObjectURL(file);
  image.onload = () => URL.revokeObjectURL(url);  // shown: the browser keeps what it decoded
  image.onerror = () => {  // not an image the browser can show either: the error says why
    URL.revokeObjectURL(url);
    image.remove();
  };
  image.src = url;
  const { region, body } = answerRegion(file.name, "h2");
  element.append(image, region);
  results.append(element);  // in the order the photos were chosen
  return body;
}

function offerExplanation(body, file, target, top) {
  // A "Why <label>?" button under the answer; the overlay goes beside the scores, in a holder that takes the focus
  // from the button and says what came (a live region).
  const holder = document.createElement("div");
  holder.className = "explanation";
  holder.tabIndex = -1;
  holder.setAttribute("aria-live", "polite");
  const button = document.createElement("button");
  button.type = "button";
  button.className = "why";
  button.textContent = `Why ${top.label}?`;
  // a rollout's two sides each have one: named apart for a screen reader (the same text twice, before)
  if (answerHolder(body).classList.contains("side")) {
    button.setAttribute("aria-label", `Why ${top.label}? (version ${target.version})`);  // its text, then which
  }
  button.addEventListener("click", () => explainInto(holder, button, file, target, top));
  answerHolder(body).append(button, holder);
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
  answerHolder(body).append(meta);  // the timings are not read out with the answer
}

async function answerInto(body, file, target) {
  // POST ``file`` to target() ({model, version}, each null: none named; asked again for each try) and show the
  // answer, or the error, in ``body``; returns the answer shown, or null for an error. An answer from a version the
  // page does not list (swapped in meanwhile) reads the models again.
  let sent = null;
  try {
    const result = await post(() => predictUrl(sent = target()), file, body);
    const { response } = result;
    let answer = null;
    if (response.ok) {
      try { answer = await response.json(); } catch (_) { /* not JSON: reported below */ }
    }
    if (answer) {
      showPrediction(body, answer, response);
      const { name, version } = answer.model;
      offerExplanation(body, file, { model: name, version: sent.version }, answer.predictions[0]);
      if (!served.some((m) => m.name === name && m.version === version)) readModels();
      return answer;
    }
    body.className = "body error";
    body.textContent = response.ok ? errorText(response.status, null) : failureText(result);
    if (response.status === 401) needKey(result.keySent, ", then pick the photo again");
  } catch (err) {
    body.className = "body error";
    body.textContent = "The request failed: " + err;
  }
  return null;
}

function side(title, photo) {
  // One version's half of a compared card: its heading (under the photo's), and where its answer goes.
  const section = document.createElement("section");
  section.className = "side";
  const { region, body } = answerRegion(title, "h3", photo);
  section.append(region);
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
  const body = card(file), name = pair.live.name;
  body.closest(".card").classList.add("compared");
  body.parentElement.removeAttribute("aria-live");  // each side's answer and the verdict are live regions of their own
  body.parentElement.removeAttribute("aria-atomic");
  const live = side(`Live · version ${pair.live.version}`, file.name);
  const candidate = side(`Candidate (${pair.role}) · version ${pair.candidate.version}`, file.name);
  const sides = document.createElement("div");
  sides.className = "sides";
  sides.append(live.section, candidate.section);
  const line = document.createElement("p");
  line.className = "verdict";
  line.setAttribute("aria-live", "polite");  // in the page before its text, so the text is announced
  body.replaceChildren(sides, line);
  const answers = await Promise.all([answerInto(live.body, file, () => ({ model: name, version: pair.live.version })),
                                     answerInto(candidate.body, file,
                                                () => ({ model: name, version: pair.candidate.version }))]);
  const { text, kind } = verdict(pair, ...answers);
  const said = document.createElement("span");  // heard with the photo it compares (the card's heading)
  said.className = "visually-hidden";
  said.textContent = `${file.name}: `;
  line.replaceChildren(said, text);
  line.classList.add(kind);
  refreshRollouts();
}

function picked() {
  // What the pickers say now: {model, version}, each null when none is to be named.
  return { model: modelPick.disabled ? null : modelPick.value, version: pinnedVersion() };
}

function classify(file) {
  const pair = chosenPair();
  if (pair) return classifyBoth(file, pair);
  return answerInto(card(file), file, picked);
}

function topKProblem() {
  // What is wrong with "Classes per photo" as typed (null: empty, the server's default, or a whole number of 1 or
  // more), said on the field too (aria-invalid). Before, each photo's card said the server's 400 again.
  const input = $("top-k"), value = input.value.trim();
  const fine = input.validity.valid && (value === "" || /^[1-9][0-9]*$/.test(value));
  input.setAttribute("aria-invalid", String(!fine));
  if (fine) input.removeAttribute("aria-describedby"); else input.setAttribute("aria-describedby", "notice");
  return fine ? null : "Classes per photo must be a whole number, 1 or more (or empty: the server's default); " +
                       "then pick the photos again.";
}

function classifyAll(files) {
  const problem = topKProblem();
  if (problem) {  // nothing sent: the field says what to fix, and has the focus
    notice.textContent = problem;
    $("top-k").focus();
    return;
  }
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
// Photos dropped anywhere on the page are classified: dropped beside the dashed zone, the browser would open the
// file in this tab instead, and every answer shown would be lost. Other drags (text into a box) are left alone.
const drop = $("drop");
const carriesFiles = (event) => event.dataTransfer !== null && Array.from(event.dataTransfer.types).includes("Files");
window.addEventListener("dragover", (event) => {
  if (!carriesFiles(event)) return;
  event.preventDefault();
  event.dataTransfer.dropEffect = "copy";
  drop.classList.add("over");
});
window.addEventListener("dragleave", (event) => {
  if (event.relatedTarget === null) drop.classList.remove("over");  // left the page
});
window.addEventListener("drop", (event) => {
  if (!carriesFiles(event)) return;
  event.preventDefault();
  drop.classList.remove("over");
  classifyAll(event.dataTransfer.files);
});
modelPick.addEventListener("change", () => fillVersions());
versionPick.addEventListener("change", describeChoice);
// The models again with a key entered: as the box is left or Enter pressed in it (and before photos are sent).
keyInput.addEventListener("blur", keyChanged);  // (change would miss a typo undone: the value it came with)
keyInput.addEventListener("keydown", (event) => {
  if (event.key === "Enter") keyChanged();
});
// a number put right is no longer marked wrong (checked again as it is edited, once it was found wrong)
$("top-k").addEventListener("input", () => {
  const wrong = $("top-k").getAttribute("aria-invalid") === "true";
  if (wrong && topKProblem() === null && notice.textContent.startsWith("Classes per photo")) notice.textContent = "";
});
readModels();
