// The page of `python -m inference.serve`: frames on the canvas, the player's input to the server
// (protocol version 1, docs/serve.md). Plain JavaScript, no build step.
"use strict";
(() => {
  const N_BUTTONS = 11, NO_SEQ = 0xFFFFFFFF;
  const params = new URLSearchParams(location.search);
  const canvas = document.getElementById("view"), ctx = canvas.getContext("2d");
  const overlay = document.getElementById("overlay"), notice = document.getElementById("notice");
  const ui = Object.fromEntries(["restart", "level", "pause", "record", "reconnect"].map(id => [id, document.getElementById(id)]));
  let ws = null, welcome = null, seq = 0, dx = 0, dy = 0, moved = false, drawn = 0;
  let held = new Array(N_BUTTONS).fill(0);
  const sent = new Map();  // seq -> when it was sent
  const latencies = [], arrivals = [];
  const status = { players: 0, capacity: 0, frame: 0, paused: false, recording: false };

  function show(text) { notice.textContent = text; notice.hidden = !text; }

  function connect() {
    show("");
    ui.reconnect.hidden = true;
    ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws");
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      const hello = { type: "hello", version: 1 };
      for (const key of ["seed", "level"]) if (params.has(key)) hello[key] = Number(params.get(key));
      if (params.has("format")) hello.format = params.get("format");
      ws.send(JSON.stringify(hello));
    };
    ws.onmessage = (e) => (typeof e.data === "string" ? onMessage(JSON.parse(e.data)) : onFrame(e.data));
    ws.onclose = (e) => {
      for (const b of ["restart", "level", "pause", "record"]) ui[b].disabled = true;
      ui.reconnect.hidden = false;
      if (notice.hidden) show(`disconnected${e.reason ? ": " + e.reason : ""} (code ${e.code})`);
      welcome = null;
    };
  }

  function onMessage(m) {
    if (m.type === "welcome") {
      welcome = m;
      [canvas.height, canvas.width] = m.frame_size;
      for (const b of ["restart", "level", "pause", "record"]) ui[b].disabled = false;
      status.players = m.players; status.capacity = m.capacity;
    } else if (m.type === "status") {
      Object.assign(status, { players: m.players, capacity: m.capacity, paused: m.paused, dropped: m.dropped, compile: m.compile });
    } else if (m.type === "state") {
      status.paused = m.paused;
      ui.pause.textContent = m.paused ? "resume" : "pause";
    } else if (m.type === "full") {
      show(m.message);
    } else if (m.type === "recording") {
      status.recording = m.state === "started";
      ui.record.classList.toggle("on", status.recording);
      ui.record.textContent = status.recording ? "stop recording" : "record";
      if (m.state === "done") {
        const a = document.createElement("a");
        a.href = m.url; a.download = ""; document.body.appendChild(a); a.click(); a.remove();
      }
    } else if (m.type === "level") {
      status.level = m.level;
    } else if (m.type === "error") {
      show(m.message);
      setTimeout(() => { if (notice.textContent === m.message && ws && ws.readyState === 1) show(""); }, 4000);
    }
    draw();
  }

  function onFrame(buffer) {
    const view = new DataView(buffer);
    if (buffer.byteLength < 16 || view.getUint32(0, false) !== 0x4F574C46) return;  // "OWLF"
    const index = view.getUint32(4, true), used = view.getUint32(8, true), now = performance.now();
    if (used !== NO_SEQ) {
      for (const [s, t] of sent) if (s <= used) { latencies.push(now - t); sent.delete(s); }
      while (latencies.length > 30) latencies.shift();
    }
    arrivals.push(now);
    while (arrivals.length && arrivals[0] < now - 2000) arrivals.shift();
    const type = welcome && welcome.format === "png" ? "image/png" : "image/jpeg";
    createImageBitmap(new Blob([new Uint8Array(buffer, 16)], { type })).then((bitmap) => {
      if (index > drawn) {
        ctx.drawImage(bitmap, 0, 0);
        drawn = index;
        canvas.dataset.frame = index;
        status.frame = index;
      }
      bitmap.close();
      draw();
    });
  }

  function median(xs) { const s = [...xs].sort((a, b) => a - b); return s.length ? s[s.length >> 1] : NaN; }

  function draw() {
    const fps = arrivals.length > 1 ? (arrivals.length - 1) * 1000 / (arrivals[arrivals.length - 1] - arrivals[0]) : 0;
    const lat = median(latencies);
    overlay.textContent = welcome ?
      `${fps.toFixed(1)} FPS   key->frame ${isNaN(lat) ? "-" : lat.toFixed(0) + " ms"}   frame ${status.frame}` +
      `\nKV ${welcome.kv}   players ${status.players}/${status.capacity}` +
      (status.paused ? "   PAUSED" : "") + (status.recording ? "   REC" : "") : "connecting ...";
  }

  function send(message) { if (ws && ws.readyState === 1 && welcome) ws.send(JSON.stringify(message)); }

  function sendControls() {
    seq = (seq + 1) % NO_SEQ;
    sent.set(seq, performance.now());
    if (sent.size > 200) sent.delete(sent.keys().next().value);
    send({ type: "controls", mouse: [dx, dy], buttons: held, seq });
    dx = dy = 0; moved = false;
  }

  function setButton(index, down) {
    if (index === undefined || held[index] === down) return;
    held = held.slice(); held[index] = down;
    sendControls();
  }

  addEventListener("keydown", (e) => {
    if (!welcome || e.repeat || !(e.code in welcome.bindings.keys)) return;
    e.preventDefault(); setButton(welcome.bindings.keys[e.code], 1);
  });
  addEventListener("keyup", (e) => {
    if (!welcome || !(e.code in welcome.bindings.keys)) return;
    e.preventDefault(); setButton(welcome.bindings.keys[e.code], 0);
  });
  addEventListener("blur", () => { if (held.some(Boolean)) { held = new Array(N_BUTTONS).fill(0); sendControls(); } });
  canvas.addEventListener("click", () => { if (document.pointerLockElement !== canvas) canvas.requestPointerLock(); });
  for (const [type, down] of [["mousedown", 1], ["mouseup", 0]]) {
    canvas.addEventListener(type, (e) => {
      if (welcome && document.pointerLockElement === canvas) setButton(welcome.bindings.mouse[String(e.button)], down);
    });
  }
  canvas.addEventListener("contextmenu", (e) => e.preventDefault());
  document.addEventListener("mousemove", (e) => {
    if (!welcome || document.pointerLockElement !== canvas) return;
    dx += e.movementX * welcome.sensitivity; dy += e.movementY * welcome.sensitivity; moved = true;
  });
  (function tick() { if (moved) sendControls(); requestAnimationFrame(tick); })();  // motion: once a display frame

  const actions = {
    restart: () => "restart", level: () => "level", pause: () => (status.paused ? "resume" : "pause"),
    record: () => (status.recording ? "record_stop" : "record_start"),
  };
  for (const [id, name] of Object.entries(actions)) {
    ui[id].onclick = () => { send({ type: "event", name: name() }); ui[id].blur(); };  // keys go to the game again
  }
  ui.reconnect.onclick = connect;
  setInterval(draw, 500);
  connect();
})();
