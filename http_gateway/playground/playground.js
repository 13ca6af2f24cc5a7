// tpuserve logprob playground: plain JS, no dependencies, no network beyond this gateway's own /v1 API.
"use strict";

(() => {
  const KEY_STORAGE = "tpuserve-playground-api-key"; // sessionStorage only: gone when the tab closes
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  };

  const state = { mode: "chat", lang: "curl", abort: null, last: null, tokens: [], pinned: null, hideTimer: 0, quiet: false, usage: null, failed: false };

  // ---- bytes and text ---------------------------------------------------------------------------------

  const hex2 = (b) => b.toString(16).padStart(2, "0");

  /** Raw bytes -> [{text, esc}] segments: valid UTF-8 decoded, every other byte as a `\xNN` escape (as the
   * gateway writes a token's text: Python's backslashreplace), never U+FFFD. */
  function bytesToSegments(bytes) {
    const out = [];
    const push = (text, esc) => {
      const last = out[out.length - 1];
      if (last && last.esc === esc) last.text += text;
      else out.push({ text, esc });
    };
    const cont = (b, lo = 0x80, hi = 0xbf) => b !== undefined && b >= lo && b <= hi;
    let i = 0;
    while (i < bytes.length) {
      const b = bytes[i];
      let len = 0;
      let cp = 0;
      if (b < 0x80) { len = 1; cp = b; }
      else if (b >= 0xc2 && b <= 0xdf && cont(bytes[i + 1])) { len = 2; cp = ((b & 0x1f) << 6) | (bytes[i + 1] & 0x3f); }
      else if (b >= 0xe0 && b <= 0xef) {
        const lo = b === 0xe0 ? 0xa0 : 0x80;
        const hi = b === 0xed ? 0x9f : 0xbf;
        if (cont(bytes[i + 1], lo, hi) && cont(bytes[i + 2])) {
          len = 3;
          cp = ((b & 0x0f) << 12) | ((bytes[i + 1] & 0x3f) << 6) | (bytes[i + 2] & 0x3f);
        }
      } else if (b >= 0xf0 && b <= 0xf4) {
        const lo = b === 0xf0 ? 0x90 : 0x80;
        const hi = b === 0xf4 ? 0x8f : 0xbf;
        if (cont(bytes[i + 1], lo, hi) && cont(bytes[i + 2]) && cont(bytes[i + 3])) {
          len = 4;
          cp = ((b & 0x07) << 18) | ((bytes[i + 1] & 0x3f) << 12) | ((bytes[i + 2] & 0x3f) << 6) | (bytes[i + 3] & 0x3f);
        }
      }
      if (len) { push(String.fromCodePoint(cp), false); i += len; }
      else { push("\\x" + hex2(b), true); i += 1; }
    }
    return out;
  }

  const encoder = new TextEncoder();
  /** A legacy-completions token string -> its bytes: the gateway writes undecodable bytes as `\xNN`, so those
   * escapes are bytes and the rest is UTF-8 text. (A token whose own text is a backslash, "x" and two hex digits
   * reads the same; the chat entries' `bytes` field has no such ambiguity.) */
  function stringToBytes(s) {
    const out = [];
    const re = /\\x([0-9a-f]{2})/g;
    let at = 0;
    for (const m of s.matchAll(re)) {
      out.push(...encoder.encode(s.slice(at, m.index)));
      out.push(parseInt(m[1], 16));
      at = m.index + m[0].length;
    }
    out.push(...encoder.encode(s.slice(at)));
    return out;
  }

  const SPECIAL = /^(<\|[^|<>\s]{1,64}\|>|<\/?s>|<unk>|<pad>|\[(?:INST|\/INST|BOS|EOS|PAD)\])$/;
  const looksSpecial = (s) => SPECIAL.test(s);
  const bytesEscaped = (bytes) => (bytes === null ? "special (no bytes)" : bytes.map((b) => "\\x" + hex2(b)).join("") || "(empty)");
  const prob = (lp) => (lp === null || lp === undefined ? null : Math.exp(lp));
  const fmtP = (p) => (p === null ? "–" : p >= 0.001 ? p.toFixed(3) : p.toExponential(1));
  const fmtLp = (lp) => (lp === null || lp === undefined ? "null" : lp.toFixed(4));
  const bucket = (p) => (p === null ? "pnone" : p >= 0.9 ? "p6" : p >= 0.7 ? "p5" : p >= 0.5 ? "p4" : p >= 0.3 ? "p3" : p >= 0.1 ? "p2" : "p1");

  /** A token's text as DOM: escapes highlighted, line breaks shown as ↵; `spaces`: spaces shown as ␣ (in the
   * popover, where a leading space is otherwise invisible). Returns the number of line breaks. */
  function renderText(parent, tok, spaces = false) {
    if (tok.bytes === null) { parent.append(tok.token); return 0; }
    let breaks = 0;
    for (const seg of bytesToSegments(tok.bytes)) {
      if (seg.esc) { parent.append(el("span", "esc", seg.text)); continue; }
      for (const part of seg.text.split(/(\n| )/)) {
        if (part === "\n") { parent.append(el("span", "nl", "↵")); breaks += 1; }
        else if (part === " " && spaces) parent.append(el("span", "sp", "␣"));
        else if (part) parent.append(part);
      }
    }
    return breaks;
  }
  const quoted = (tok) => (tok.bytes === null ? tok.token : JSON.stringify(bytesToSegments(tok.bytes).map((s) => s.text).join("")));

  // ---- tokens: normalised from both API shapes ------------------------------------------------------------

  /** A chat `logprobs.content` entry -> token. */
  function fromChat(e) {
    const alts = e.top_logprobs.map((t) => ({ token: t.token, bytes: t.bytes, logprob: t.logprob }));
    const same = (t) => t.token === e.token && JSON.stringify(t.bytes) === JSON.stringify(e.bytes);
    const at = alts.findIndex(same);
    return { token: e.token, bytes: e.bytes, logprob: e.logprob, alts, sampled: at, rank: at >= 0 ? at + 1 : null, k: alts.length, special: e.bytes === null };
  }

  /** Legacy completions: token string, logprob (null for the first echoed token), top dict (k + maybe the
   * sampled token, as the gateway sends). */
  function fromLegacy(token, logprob, top, k, prompt) {
    const special = looksSpecial(token);
    const asBytes = (s) => (looksSpecial(s) ? null : stringToBytes(s));
    const alts = top ? Object.entries(top).map(([t, lp]) => ({ token: t, bytes: asBytes(t), logprob: lp })).sort((a, b) => b.logprob - a.logprob) : [];
    const at = alts.findIndex((t) => t.token === token);
    let rank = null;
    if (logprob !== null && top) {
      const above = alts.filter((t) => t.token !== token && t.logprob > logprob).length;
      if (above < k) rank = above + 1;
    }
    return { token, bytes: special ? null : stringToBytes(token), logprob, alts, sampled: at, rank, k, special, prompt };
  }

  // ---- rendering ----------------------------------------------------------------------------------------

  function addToken(tok) {
    const i = state.tokens.length;
    state.tokens.push(tok);
    const b = el("button", "tok " + bucket(prob(tok.logprob)) + (tok.special ? " special" : "") + (tok.prompt ? " echoed" : ""));
    b.type = "button";
    b.dataset.i = String(i);
    b.dataset.token = tok.token;
    b.dataset.logprob = tok.logprob === null ? "null" : String(tok.logprob);
    b.dataset.bytes = JSON.stringify(tok.bytes);
    b.dataset.rank = tok.rank === null ? "" : String(tok.rank);
    b.dataset.alts = JSON.stringify(tok.alts.map((t) => [t.token, t.logprob, t.bytes]));
    b.setAttribute("aria-haspopup", "dialog");
    b.setAttribute("aria-expanded", "false");
    b.setAttribute("aria-label", `${quoted(tok)}, probability ${fmtP(prob(tok.logprob))}${tok.special ? ", special token" : ""}`);
    const breaks = renderText(b, tok);
    $("output").append(b);
    if (breaks) $("output").append("\n".repeat(breaks));  // the text's line breaks, after the token's ↵
  }

  function showStats(extra) {
    const scored = state.tokens.map((t) => t.logprob).filter((lp) => lp !== null);
    const total = scored.reduce((a, b) => a + b, 0);
    const mean = scored.length ? total / scored.length : null;
    const box = $("stats");
    box.replaceChildren();
    box.dataset.total = String(total);
    box.dataset.count = String(scored.length);
    box.dataset.mean = mean === null ? "" : String(mean);
    const item = (label, value) => { const s = el("span", null, label + " "); s.append(el("b", null, value)); box.append(s); };
    item("tokens", String(state.tokens.length));
    if (state.mode === "score") item("scored", String(scored.length));
    item("total logprob", total.toFixed(4));
    item("mean", mean === null ? "–" : mean.toFixed(4));
    item("perplexity", mean === null ? "–" : Math.exp(-mean).toFixed(3));
    if (extra) item(extra[0], extra[1]);
    box.hidden = false;
  }

  // ---- the alternatives popover -------------------------------------------------------------------------

  function fillPop(tok) {
    const pop = $("pop");
    pop.replaceChildren();
    const h = el("h3");
    renderText(h, tok, true);
    if (tok.special) h.append(el("span", "tag sp", "special"));
    pop.append(h);
    const p = prob(tok.logprob);
    let meta = `p ${fmtP(p)} · logprob ${fmtLp(tok.logprob)} · bytes ${bytesEscaped(tok.bytes)}`;
    if (tok.logprob === null) meta = "first token: no prefix, no logprob · bytes " + bytesEscaped(tok.bytes);
    else if (tok.alts.length) meta += tok.rank ? ` · rank ${tok.rank} of top ${tok.k}` : ` · not in the top ${tok.k}`;
    pop.append(el("div", "meta", meta));
    if (!tok.alts.length) {
      pop.append(el("div", "meta", tok.logprob === null ? "" : "No alternatives requested (top logprobs 0)."));
      return;
    }
    const table = el("table");
    const head = el("tr");
    for (const [c, cls] of [["#", ""], ["token", ""], ["bytes", "b"], ["logprob", "num"], ["p", "num"]]) head.append(el("th", cls, c));
    table.append(head);
    tok.alts.forEach((alt, i) => {
      const tr = el("tr", i === tok.sampled ? "sampled" : "");
      tr.append(el("td", "num", String(i + 1)));
      const t = el("td", "t");
      renderText(t, alt, true);
      if (alt.bytes === null) t.append(el("span", "tag sp", "special"));
      if (i === tok.sampled) t.append(el("span", "tag", tok.prompt ? "actual" : "sampled"));
      tr.append(t, el("td", "b", bytesEscaped(alt.bytes)), el("td", "num", fmtLp(alt.logprob)), el("td", "num", fmtP(prob(alt.logprob))));
      table.append(tr);
    });
    pop.append(table);
    if (tok.sampled < 0 && tok.logprob !== null) pop.append(el("div", "meta", `The ${tok.prompt ? "actual" : "sampled"} token is not among these alternatives.`));
  }

  function openPop(button, pin) {
    clearTimeout(state.hideTimer);
    const tok = state.tokens[Number(button.dataset.i)];
    if (!tok) return;
    for (const b of document.querySelectorAll('.tok[aria-expanded="true"]')) if (b !== button) b.setAttribute("aria-expanded", "false");
    fillPop(tok);
    const pop = $("pop");
    pop.hidden = false;
    pop.dataset.for = button.dataset.i;
    button.setAttribute("aria-expanded", "true");
    button.setAttribute("aria-controls", "pop");
    state.pinned = pin ? button : null;
    const r = button.getBoundingClientRect();
    const width = pop.offsetWidth;
    const left = Math.max(8, Math.min(r.left, document.documentElement.clientWidth - width - 8));
    pop.style.left = `${left + window.scrollX}px`;
    pop.style.top = `${r.bottom + window.scrollY + 4}px`;
  }

  function closePop() {
    clearTimeout(state.hideTimer);
    $("pop").hidden = true;
    state.pinned = null;
    for (const b of document.querySelectorAll('.tok[aria-expanded="true"]')) b.setAttribute("aria-expanded", "false");
  }

  const laterClose = () => {
    if (state.pinned) return;
    clearTimeout(state.hideTimer);
    state.hideTimer = setTimeout(closePop, 150);
  };

  function wirePopover() {
    const out = $("output");
    out.addEventListener("mouseover", (e) => { const b = e.target.closest(".tok"); if (b && !state.pinned) openPop(b, false); });
    out.addEventListener("mouseout", (e) => { if (e.target.closest(".tok")) laterClose(); });
    out.addEventListener("focusin", (e) => { const b = e.target.closest(".tok"); if (b && !state.quiet && state.pinned !== b) openPop(b, false); });
    out.addEventListener("focusout", () => laterClose());
    out.addEventListener("click", (e) => {  // mouse click, tap, Enter and Space all arrive here
      const b = e.target.closest(".tok");
      if (!b) return;
      if (state.pinned === b) closePop();
      else openPop(b, true);
    });
    out.addEventListener("keydown", (e) => {
      const b = e.target.closest(".tok");
      if (!b) return;
      const step = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
      if (step) {
        const next = out.querySelector(`.tok[data-i="${Number(b.dataset.i) + step}"]`);
        if (next) { e.preventDefault(); next.focus(); }
      }
    });
    const pop = $("pop");
    pop.addEventListener("mouseover", () => clearTimeout(state.hideTimer));
    pop.addEventListener("mouseout", () => laterClose());
    document.addEventListener("keydown", (e) => {
      if (e.key !== "Escape" || pop.hidden) return;
      const owner = document.querySelector(`.tok[data-i="${pop.dataset.for}"]`);
      closePop();
      if (owner && document.activeElement !== owner) {
        state.quiet = true;  // back to the token without reopening its popover
        owner.focus({ preventScroll: true });
        state.quiet = false;
      }
    });
    document.addEventListener("click", (e) => { if (!e.target.closest(".tok") && !e.target.closest("#pop")) closePop(); });
  }

  // ---- requests -----------------------------------------------------------------------------------------

  const num = (id) => { const v = $(id).value.trim(); return v === "" ? null : Number(v); };
  const apiKey = () => $("api-key").value.trim();

  function stops() {
    return $("stop").value.split("\n").filter((s) => s !== "").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
  }

  function buildRequest() {
    const model = $("model").value;
    const k = Math.max(0, Math.min(20, num("top-logprobs") ?? 0));
    const text = $("prompt").value;
    if (state.mode === "score") {
      return { path: "/v1/completions", stream: false, body: { model, prompt: text, echo: true, max_tokens: 0, logprobs: k } };
    }
    const body = { model };
    if (state.mode === "chat") {
      const messages = [];
      if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
      messages.push({ role: "user", content: text });
      body.messages = messages;
      body.logprobs = true;
      body.top_logprobs = k;
    } else {
      body.prompt = text;
      body.logprobs = k;
    }
    body.max_tokens = num("max-tokens") ?? 16;
    for (const [id, key] of [["temperature", "temperature"], ["top-p", "top_p"], ["seed", "seed"]]) {
      const v = num(id);
      if (v !== null) body[key] = v;
    }
    const s = stops();
    if (s.length) body.stop = s;
    body.stream = true;
    body.stream_options = { include_usage: true };
    return { path: state.mode === "chat" ? "/v1/chat/completions" : "/v1/completions", stream: true, body };
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
    return h;
  }

  function showError(message) {
    const box = $("error");
    box.textContent = message;
    box.hidden = false;
  }
  const clearError = () => { $("error").hidden = true; $("error").textContent = ""; };

  async function errorMessage(resp) {
    let text = "";
    try { text = await resp.text(); } catch (_) { /* the body could not be read */ }
    let message = text.trim() || resp.statusText;
    try { const j = JSON.parse(text); if (j && j.error && j.error.message) message = j.error.message; } catch (_) { /* not JSON */ }
    return `${resp.status} ${resp.statusText || ""}`.trim() + `: ${message}`;
  }

  const base = () => new URL(".", window.location.href).href.replace(/\/$/, "");
  const url = (path) => base() + path;

  async function loadModels() {
    try {
      const resp = await fetch(url("/v1/models"), { headers: headers() });
      if (!resp.ok) { showError(await errorMessage(resp)); return false; }
      const data = (await resp.json()).data || [];
      const select = $("model");
      const keep = select.value;
      select.replaceChildren(...data.map((m) => { const o = el("option", null, m.id); o.value = m.id; return o; }));
      if (!data.length) select.append(el("option", null, "(no model)"));
      if (keep && data.some((m) => m.id === keep)) select.value = keep;
      clearError();
      return data.length > 0;
    } catch (err) {
      showError(`Could not reach the gateway: ${err.message}`);
      return false;
    }
  }

  /** SSE `data:` payloads from a fetch body, as they arrive. */
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  function onChunk(obj) {
    if (obj.error) { state.failed = true; showError(`Error during the stream: ${obj.error.message}`); return null; }
    let finish = null;
    for (const choice of obj.choices || []) {
      if (choice.index !== 0) continue;
      const lp = choice.logprobs;
      if (lp && state.mode === "chat") for (const e of lp.content || []) addToken(fromChat(e));
      if (lp && state.mode !== "chat") {
        lp.tokens.forEach((t, i) => addToken(fromLegacy(t, lp.token_logprobs[i], lp.top_logprobs ? lp.top_logprobs[i] : null, state.last.k, false)));
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (obj.usage) state.usage = obj.usage;
    return finish;
  }

  async function run() {
    if (state.abort) return;
    clearError();
    closePop();
    if (!$("model").value && !(await loadModels())) return;
    const req = buildRequest();
    req.k = state.mode === "chat" ? req.body.top_logprobs : req.body.logprobs;
    state.last = req;
    state.tokens = [];
    state.usage = null;
    state.failed = false;
    renderCode();
    const out = $("output");
    out.replaceChildren();
    $("stats").hidden = true;
    if (state.mode === "completion") out.append(el("span", "prompt-text", req.body.prompt));
    const abort = new AbortController();
    state.abort = abort;
    $("run").disabled = true;
    $("stop-button").disabled = false;
    setStatus(req.stream ? "Streaming…" : "Scoring…", "running");
    let finish = null;
    try {
      const resp = await fetch(url(req.path), { method: "POST", headers: headers(), body: JSON.stringify(req.body), signal: abort.signal });
      if (!resp.ok) { showError(await errorMessage(resp)); setStatus("Failed.", "error"); return; }
      if (req.stream) {
        for await (const data of sseEvents(resp.body)) {
          if (data === "[DONE]") break;
          finish = onChunk(JSON.parse(data)) || finish;
          if (state.tokens.length) showStats();
        }
      } else {
        const result = await resp.json();
        const lp = result.choices[0].logprobs;
        lp.tokens.forEach((t, i) => addToken(fromLegacy(t, lp.token_logprobs[i], lp.top_logprobs ? lp.top_logprobs[i] : null, req.k, true)));
        finish = result.choices[0].finish_reason;
      }
      showStats();
      const usage = state.usage ? ` · ${state.usage.prompt_tokens} prompt + ${state.usage.completion_tokens} completion tokens` : "";
      const scored = `Scored ${state.tokens.length} prompt tokens (the first has no prefix, so no logprob).`;
      if (state.failed) setStatus("Failed during the stream.", "error");
      else setStatus(req.stream ? `Done (finish_reason: ${finish})${usage}.` : scored, "done");
    } catch (err) {
      if (err.name === "AbortError") { setStatus("Stopped: the request was cancelled.", "stopped"); if (state.tokens.length) showStats(); }
      else { showError(`Request failed: ${err.message}`); setStatus("Failed.", "error"); }
    } finally {
      state.abort = null;
      $("run").disabled = false;
      $("stop-button").disabled = true;
    }
  }

  function setStatus(text, phase) {
    $("status").textContent = text;
    $("status").dataset.phase = phase;
  }

  // ---- copy as code -------------------------------------------------------------------------------------

  const shellQuote = (s) => `'${s.replace(/'/g, "'\\''")}'`;

  /** A JSON value as a Python literal (JSON strings are valid Python string literals). */
  function py(v) {
    if (v === null) return "None";
    if (v === true) return "True";
    if (v === false) return "False";
    if (Array.isArray(v)) return `[${v.map(py).join(", ")}]`;
    if (typeof v === "object") return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${py(x)}`).join(", ")}}`;
    return JSON.stringify(v);
  }

  function curlCode(req) {
    return [
      `curl -sS${req.stream ? "N" : ""} ${url(req.path)} \\`,
      `  -H "Content-Type: application/json" \\`,
      `  -H "Authorization: Bearer $OPENAI_API_KEY" \\`,
      `  -d ${shellQuote(JSON.stringify(req.body, null, 2))}`,
    ].join("\n");
  }

  function pythonCode(req) {
    const kwargs = Object.entries(req.body).map(([k, v]) => `    ${k}=${py(v)},`).join("\n");
    const lines = ["import os", "", "from openai import OpenAI", "",
      `client = OpenAI(base_url=${JSON.stringify(base() + "/v1")}, api_key=os.environ.get("OPENAI_API_KEY", "unused"))`, ""];
    if (state.last && req.path === "/v1/chat/completions") {
      lines.push("stream = client.chat.completions.create(", kwargs, ")", "for chunk in stream:",
        "    if chunk.choices and chunk.choices[0].logprobs:",
        "        for entry in chunk.choices[0].logprobs.content:",
        "            alternatives = [(t.token, t.logprob) for t in entry.top_logprobs]",
        "            print(repr(entry.token), entry.bytes, entry.logprob, alternatives)");
    } else if (req.stream) {
      lines.push("stream = client.completions.create(", kwargs, ")", "for chunk in stream:",
        "    if chunk.choices and chunk.choices[0].logprobs:",
        "        logprobs = chunk.choices[0].logprobs",
        "        for i, token in enumerate(logprobs.tokens):",
        "            top = logprobs.top_logprobs[i] if logprobs.top_logprobs else None",
        "            print(repr(token), logprobs.token_logprobs[i], top)");
    } else {
      lines.push("completion = client.completions.create(", kwargs, ")",
        "logprobs = completion.choices[0].logprobs",
        "scored = [lp for lp in logprobs.token_logprobs if lp is not None]  # the first token has no prefix",
        "total = sum(scored)",
        "print(f\"total logprob {total:.4f}, mean {total / len(scored):.4f}\")");
    }
    return lines.join("\n");
  }

  function renderCode() {
    if (!state.last) return;
    const code = $("code");
    const text = state.lang === "curl" ? curlCode(state.last) : pythonCode(state.last);
    code.replaceChildren(el("code", null, text));
    code.dataset.lang = state.lang;
  }

  async function copyCode() {
    const text = $("code").textContent;
    try {
      await navigator.clipboard.writeText(text);
      setStatus("Copied.", $("status").dataset.phase || "");
    } catch (_) {  // not a secure context: select it for Ctrl+C
      const range = document.createRange();
      range.selectNodeContents($("code"));
      const sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      setStatus("Selected: press Ctrl+C to copy.", $("status").dataset.phase || "");
    }
  }

  // ---- modes and wiring ---------------------------------------------------------------------------------

  function setMode(mode) {
    state.mode = mode;
    document.body.dataset.mode = mode;
    for (const b of document.querySelectorAll("[data-mode]")) if (b.tagName === "BUTTON") b.setAttribute("aria-selected", String(b.dataset.mode === mode));
    $("prompt-caption").textContent = mode === "chat" ? "Message" : mode === "completion" ? "Prompt" : "Text to score";
    $("run").firstChild.textContent = mode === "score" ? "Score " : "Run ";
  }

  function tabKeys(container, attr, activate) {
    container.addEventListener("keydown", (e) => {
      if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
      const tabs = [...container.querySelectorAll(`[${attr}]`)];
      const at = tabs.indexOf(document.activeElement);
      if (at < 0) return;
      const next = tabs[(at + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length];
      next.focus();
      activate(next);
    });
  }

  function init() {
    const key = $("api-key");
    key.value = sessionStorage.getItem(KEY_STORAGE) || "";
    key.addEventListener("input", () => {
      if (key.value) sessionStorage.setItem(KEY_STORAGE, key.value);
      else sessionStorage.removeItem(KEY_STORAGE);
    });
    key.addEventListener("change", () => loadModels());
    const modes = document.querySelector(".modes");
    modes.addEventListener("click", (e) => { const b = e.target.closest("[data-mode]"); if (b) setMode(b.dataset.mode); });
    tabKeys(modes, "data-mode", (b) => setMode(b.dataset.mode));
    const langs = document.querySelector(".code-tabs");
    const setLang = (b) => {
      state.lang = b.dataset.lang;
      for (const t of langs.querySelectorAll("[data-lang]")) t.setAttribute("aria-selected", String(t === b));
      renderCode();
    };
    langs.addEventListener("click", (e) => { const b = e.target.closest("[data-lang]"); if (b) setLang(b); });
    tabKeys(langs, "data-lang", setLang);
    $("copy").addEventListener("click", copyCode);
    $("form").addEventListener("submit", (e) => { e.preventDefault(); run(); });
    $("form").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); run(); }
    });
    $("stop-button").addEventListener("click", () => { if (state.abort) state.abort.abort(); });
    wirePopover();
    setMode(state.mode);
    loadModels();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
