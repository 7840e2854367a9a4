// The onceflow view: Airflow's UI loads this module for the plugin's react_apps entry and
// renders its default export in its own page (/plugin/onceflow). It is a plain ES module with
// nothing to build: React, React Router and Chakra UI are the UI's own, from the globals it
// sets for plugins, so the view follows the UI's theme (light, dark) and router. Its data
// comes from the view's JSON API (/onceflow/api/..., onceflow.airflow.ui.app), refreshed every
// few seconds without reloading the page.

const React = globalThis.React;
const RR = globalThis.ReactRouterDOM;
const C = globalThis.ChakraUI;
const h = React.createElement;
const { useCallback, useEffect, useMemo, useRef, useState } = React;

const ROUTE = "/plugin/onceflow";
const API = new URL("onceflow/", document.baseURI).pathname.replace(/\/$/, "");
const REFRESH_KEY = "onceflow-view-refresh";
const REFRESH_CHOICES = [[5, "every 5 s"], [10, "every 10 s"], [30, "every 30 s"],
  [60, "every minute"], [0, "off"]];
const STATES = ["planned", "committed", "failed", "superseded", "abandoned"];
// Airflow's own state colours (its theme's colour palettes) for a transaction's states.
const PALETTE = { committed: "success", planned: "running", failed: "failed",
  superseded: "upstream_failed", abandoned: "up_for_retry", fenced: "skipped" };
const PAGE_SIZES = [20, 50, 100, 200];
const PAGE_MAX = 500;  // the API's most on one page (data.PAGE_MAX)
const SERIES_SIZES = [50, 200, 1000];

// -- formatting ---------------------------------------------------------------------------------
const num = (v) => (v === null || v === undefined ? "-" : Number(v).toLocaleString("en-US"));
const secs = (v) => (v === null || v === undefined ? "-" : `${Number(v).toFixed(1)}s`);
const when = (v) => (v ? v.replace("T", " ").replace("+00:00", "Z") : "-");
const clock = (d) => d.toISOString().slice(11, 19);
function short(v) {
  if (v === null || v === undefined) return "-";
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toFixed(a >= 1e7 ? 0 : 1)}M`;
  if (a >= 1e4) return `${(v / 1e3).toFixed(0)}k`;
  if (a >= 1e3) return `${(v / 1e3).toFixed(1)}k`;
  if (a >= 10 || v === 0) return String(Math.round(v));
  return v.toFixed(a >= 1 ? 1 : 2);
}

// -- the JSON API -------------------------------------------------------------------------------
async function call(path, options = {}) {
  const response = await fetch(API + path, { credentials: "same-origin", ...options });
  let answer = {};
  try { answer = await response.json(); } catch (e) { answer = {}; }
  if (!response.ok) {
    const detail = typeof answer.detail === "string" ? answer.detail : JSON.stringify(answer.detail);
    throw new Error(`${response.status}: ${detail || response.statusText}`);
  }
  return answer;
}
const post = (path, body) => call(path, {
  method: "POST",
  headers: { "Content-Type": "application/json", "X-Requested-By": "onceflow-view" },
  body: JSON.stringify(body),
});
const query = (params) => {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  }
  const text = q.toString();
  return text ? `?${text}` : "";
};

// Loads with ``load`` now, whenever ``key`` changes and every ``every`` seconds while the tab
// is visible (0: never again); a slower answer never replaces a newer one.
function usePolled(load, key, every) {
  const [state, setState] = useState({ data: null, error: null, at: null });
  const seq = useRef(0);
  const inFlight = useRef(0);
  const tick = useCallback(async () => {
    const mine = ++seq.current;
    inFlight.current += 1;
    try {
      const data = await load();
      if (mine === seq.current) setState({ data, error: null, at: new Date() });
    } catch (error) {
      if (mine === seq.current) setState((old) => ({ ...old, error: String(error.message || error), at: new Date() }));
    } finally {
      inFlight.current -= 1;
    }
  }, [key]); // eslint-disable-line react-hooks/exhaustive-deps
  useEffect(() => {
    tick();
    if (!every) return undefined;
    // A refresh waits for the request before it: a newer one discards the older answer, so
    // with a server slower than the interval the view would never change.
    const id = setInterval(() => { if (!document.hidden && !inFlight.current) tick(); }, every * 1000);
    return () => clearInterval(id);
  }, [tick, every]);
  return [state, tick];
}

function useRefreshEvery() {
  const [every, setEvery] = useState(() => {
    const kept = Number(globalThis.localStorage?.getItem(REFRESH_KEY));
    return REFRESH_CHOICES.some(([s]) => s === kept) && globalThis.localStorage?.getItem(REFRESH_KEY) !== null ? kept : 10;
  });
  const choose = (s) => { setEvery(s); globalThis.localStorage?.setItem(REFRESH_KEY, String(s)); };
  return [every, choose];
}

// -- small pieces -------------------------------------------------------------------------------
function AppLink({ to, children, ...rest }) {
  return h(C.Link, { asChild: true, color: "fg.info", ...rest }, h(RR.Link, { to }, children));
}
// A path of Airflow's UI as the API gives it ("dags/..."), for the UI's router.
const airflowPath = (path) => `/${path}`;

function StateBadge({ state }) {
  return h(C.Badge, { colorPalette: PALETTE[state] || "gray", variant: "solid", size: "sm",
    "data-state": state }, state);
}

function Section({ title, id, children, sub }) {
  return h(C.Box, { as: "section", mt: 6, id },
    h(C.Heading, { as: "h2", size: "md", mb: 1 }, title),
    sub ? h(C.Text, { color: "fg.muted", fontSize: "sm", mb: 2 }, sub) : null,
    children);
}

function Empty({ children }) {
  return h(C.Text, { color: "fg.muted", fontStyle: "italic", fontSize: "sm" }, children);
}

function ErrorBox({ children, id }) {
  return h(C.Box, { id, role: "alert", borderWidth: "1px", borderColor: "border.error",
    bg: "bg.error", color: "fg.error", rounded: "md", px: 3, py: 2, mt: 3, fontSize: "sm",
    whiteSpace: "pre-wrap" }, children);
}

// A keep-up pipeline's source watcher: the line `onceflow status` prints; an alert when no
// triggerer runs it (no run starts until one does).
function Watcher({ watcher }) {
  return watcher.running
    ? h(C.Text, { id: "onceflow-watcher", color: "fg.muted", fontSize: "sm", mt: 2 }, watcher.line)
    : h(ErrorBox, { id: "onceflow-watcher" }, watcher.line);
}

function Card({ value, label, id }) {
  return h(C.Box, { className: "onceflow-card", bg: "bg.panel", borderWidth: "1px",
    borderColor: "border", rounded: "md", px: 3, py: 2, minW: "9rem" },
  h(C.Text, { fontSize: "xl", fontWeight: "bold", id, lineHeight: "short" }, value),
  h(C.Text, { fontSize: "xs", color: "fg.muted" }, label));
}

function Grid({ id, columns, rows, empty }) {
  return h(C.Table.Root, { size: "sm", id, variant: "line", className: "onceflow-table" },
    h(C.Table.Header, null, h(C.Table.Row, null, columns.map(([label, end], i) =>
      h(C.Table.ColumnHeader, { key: i, textAlign: end ? "end" : "start", whiteSpace: "nowrap" }, label)))),
    h(C.Table.Body, null, rows.length ? rows : h(C.Table.Row, null,
      h(C.Table.Cell, { colSpan: columns.length }, h(Empty, null, empty || "none")))));
}
const Cell = (props, ...children) => h(C.Table.Cell, props, ...children);
const N = (v) => h(C.Table.Cell, { textAlign: "end", fontVariantNumeric: "tabular-nums" }, v);

function Toolbar({ every, setEvery, at, onRefresh, error }) {
  return h(C.HStack, { gap: 3, fontSize: "sm", color: "fg.muted", flexWrap: "wrap" },
    h(C.Text, { as: "span" }, "Auto-refresh"),
    h(C.NativeSelect.Root, { size: "xs", width: "9rem" },
      h(C.NativeSelect.Field, { id: "onceflow-refresh", "aria-label": "Auto-refresh",
        value: String(every), onChange: (e) => setEvery(Number(e.target.value)) },
      REFRESH_CHOICES.map(([s, label]) => h("option", { key: s, value: String(s) }, label))),
      h(C.NativeSelect.Indicator, null)),
    h(C.Button, { size: "xs", variant: "outline", onClick: onRefresh, id: "onceflow-refresh-now" }, "Refresh now"),
    h(C.Text, { as: "span", id: "onceflow-updated" }, at ? `updated ${clock(at)} UTC` : "loading…"),
    error ? h(C.Text, { as: "span", color: "fg.error" }, `last refresh failed: ${error}`) : null);
}

// -- the confirmation dialog and messages --------------------------------------------------------
function useConfirm() {
  const [asking, setAsking] = useState(null);
  const ask = useCallback((title, message) => new Promise((resolve) => {
    setAsking({ title, message, resolve });
  }), []);
  const answer = (ok) => { if (asking) asking.resolve(ok); setAsking(null); };
  const dialog = h(C.Dialog.Root, { open: asking !== null, role: "alertdialog",
    onOpenChange: (e) => { if (!e.open) answer(false); }, placement: "center" },
  h(C.Portal, null,
    h(C.Dialog.Backdrop, null),
    h(C.Dialog.Positioner, null,
      h(C.Dialog.Content, { id: "onceflow-confirm" },
        h(C.Dialog.Header, null, h(C.Dialog.Title, null, asking?.title || "Confirm")),
        h(C.Dialog.Body, null, h(C.Text, { id: "onceflow-confirm-message" }, asking?.message)),
        h(C.Dialog.Footer, null,
          h(C.Button, { variant: "outline", onClick: () => answer(false), id: "onceflow-confirm-cancel" }, "Cancel"),
          h(C.Button, { colorPalette: "red", onClick: () => answer(true), id: "onceflow-confirm-ok" }, "Confirm"))))));
  return [ask, dialog];
}

function Flash({ flash, onClose }) {
  if (!flash) return null;
  return h(C.HStack, { id: "onceflow-flash", role: "status", justify: "space-between",
    borderWidth: "1px", rounded: "md", px: 3, py: 2, my: 3, fontSize: "sm",
    borderColor: flash.error ? "border.error" : "border.success",
    bg: flash.error ? "bg.error" : "bg.success", color: flash.error ? "fg.error" : "fg.success",
    "data-error": flash.error ? "true" : "false" },
  h(C.Text, null, flash.message),
  h(C.Button, { size: "2xs", variant: "ghost", onClick: onClose, "aria-label": "Dismiss" }, "×"));
}

// -- charts --------------------------------------------------------------------------------------
const W = 560;
const H = 150;
const PAD = { l: 46, r: 10, t: 10, b: 22 };

// A line over time: ``points`` [{t: Date, y: number|null, label}], a second dashed line
// ``second`` likewise (optional).
function Chart({ id, title, unit, points, second, secondLabel, note, format = short }) {
  const shown = points.filter((p) => p.y !== null && p.y !== undefined && !Number.isNaN(p.y));
  const extra = (second || []).filter((p) => p.y !== null && p.y !== undefined);
  const all = shown.concat(extra);
  const last = shown.length ? shown[shown.length - 1] : null;
  let body;
  if (!shown.length) {
    body = h(C.Box, { h: "150px", display: "flex", alignItems: "center", justifyContent: "center",
      color: "fg.muted", fontSize: "sm", textAlign: "center", px: 4, className: "onceflow-chart-empty" },
    note || "No committed transaction in this range yet.");
  } else {
    const t0 = Math.min(...all.map((p) => p.t.getTime()));
    const t1 = Math.max(...all.map((p) => p.t.getTime()));
    const top = Math.max(...all.map((p) => p.y), 0) || 1;
    const x = (t) => PAD.l + (t1 === t0 ? (W - PAD.l - PAD.r) / 2 : ((t - t0) / (t1 - t0)) * (W - PAD.l - PAD.r));
    const y = (v) => PAD.t + (1 - v / top) * (H - PAD.t - PAD.b);
    const line = (ps) => ps.map((p) => `${x(p.t.getTime()).toFixed(1)},${y(p.y).toFixed(1)}`).join(" ");
    const axis = "var(--chakra-colors-border)";
    const text = { fill: "var(--chakra-colors-fg-muted)", style: { fontSize: "9px" } };
    body = h("svg", { viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": title,
      style: { display: "block", maxHeight: "190px" } },
    [0, 0.5, 1].map((f) => h("g", { key: f },
      h("line", { x1: PAD.l, x2: W - PAD.r, y1: y(top * f), y2: y(top * f), stroke: axis, strokeWidth: 1 }),
      h("text", { x: PAD.l - 4, y: y(top * f) + 3, textAnchor: "end", ...text }, format(top * f)))),
    h("text", { x: PAD.l, y: H - 6, ...text }, clock(new Date(t0))),
    h("text", { x: W - PAD.r, y: H - 6, textAnchor: "end", ...text }, `${clock(new Date(t1))} UTC`),
    extra.length ? h("polyline", { points: line(extra), fill: "none",
      stroke: "var(--chakra-colors-orange-solid)", strokeWidth: 1.5, strokeDasharray: "4 3" }) : null,
    h("polyline", { points: line(shown), fill: "none", stroke: "var(--chakra-colors-blue-solid)", strokeWidth: 1.8 }),
    shown.map((p, i) => h("circle", { key: i, cx: x(p.t.getTime()), cy: y(p.y), r: shown.length > 100 ? 1.3 : 2.4,
      fill: "var(--chakra-colors-blue-solid)", "data-txid": p.txid, "data-y": String(p.y) },
    h("title", null, `${p.label}: ${format(p.y)}${unit ? ` ${unit}` : ""}`))));
  }
  return h(C.Box, { id, className: "onceflow-chart", bg: "bg.panel", borderWidth: "1px", borderColor: "border",
    rounded: "md", p: 3, "data-points": String(shown.length) },
  h(C.HStack, { justify: "space-between", mb: 1, align: "baseline" },
    h(C.Text, { fontWeight: "semibold", fontSize: "sm" }, title),
    h(C.Text, { fontSize: "xs", color: "fg.muted" },
      last ? `txid ${last.txid}: ${format(last.y)}${unit ? ` ${unit}` : ""}` : "")),
  body,
  secondLabel && extra.length ? h(C.Text, { fontSize: "xs", color: "fg.muted" },
    h("span", { style: { color: "var(--chakra-colors-blue-solid)" } }, "━ "), `${title.toLowerCase()}  `,
    h("span", { style: { color: "var(--chakra-colors-orange-solid)" } }, "┅ "), secondLabel) : null,
  note && shown.length ? h(C.Text, { fontSize: "xs", color: "fg.muted" }, note) : null);
}

function Charts({ series, last, setLast }) {
  const points = series?.points || [];
  const at = (p, key = "committed_at") => new Date(p[key]);
  const mk = (key, tkey) => points.map((p) => ({ t: at(p, tkey), y: p[key], txid: p.txid,
    label: `txid ${p.txid} · ${when(p[tkey || "committed_at"])}` }));
  // the rate's points also say the txid's records, its replays (apart) and its window
  const rate = points.map((p) => ({ t: at(p), y: p.records_per_s, txid: p.txid,
    label: `txid ${p.txid} · ${num(p.records)} records${p.replayed ? ` (+ ${num(p.replayed)} replayed)` : ""}`
      + ` in ${secs(p.duration_s)}, planned ${when(p.planned_at)}, committed ${when(p.committed_at)}` }));
  const freshnessNote = series && !series.freshness
    ? "Freshness is not recorded for this pipeline's source yet: the records' arrival times are not kept."
    : series?.freshness ? `Per txid: ${series.freshness}.` : null;
  return h(C.Box, null,
    h(C.HStack, { gap: 2, mb: 2, fontSize: "sm", color: "fg.muted" },
      h(C.Text, { as: "span" }, "Over the last"),
      h(C.NativeSelect.Root, { size: "xs", width: "7rem" },
        h(C.NativeSelect.Field, { id: "onceflow-series-size", "aria-label": "Transactions in the charts",
          value: String(last), onChange: (e) => setLast(Number(e.target.value)) },
        SERIES_SIZES.map((n) => h("option", { key: n, value: String(n) }, `${n} txids`))),
        h(C.NativeSelect.Indicator, null)),
      h(C.Text, { as: "span" }, "committed (or the txid range of the timeline's filter).")),
    h(C.SimpleGrid, { columns: { base: 1, xl: 2 }, gap: 3, id: "onceflow-charts" },
      h(Chart, { id: "onceflow-chart-lag", title: "Lag", unit: "records", points: mk("lag", "planned_at"),
        note: "Records of the source past the committed offsets when each txid was planned." }),
      h(Chart, { id: "onceflow-chart-freshness", title: "Freshness", unit: "s", points: mk("freshness_s"),
        note: freshnessNote, format: (v) => short(v) }),
      h(Chart, { id: "onceflow-chart-rate", title: "Records per second", unit: "records/s",
        points: rate, note: series?.rate ? `Per txid: ${series.rate}.` : null }),
      h(Chart, { id: "onceflow-chart-commit", title: "Commit time", unit: "s", points: mk("commit_s"),
        second: mk("commit_wait_s"), secondLabel: "of which waiting for earlier txids",
        format: (v) => short(v) })));
}

// -- the overview --------------------------------------------------------------------------------
function Overview({ every, setEvery }) {
  const [state, reload] = usePolled(() => call("/api/pipelines"), "overview", every);
  const rows = (state.data || []).map((p) => h(C.Table.Row, { key: p.pipeline, "data-pipeline": p.pipeline },
    Cell(null, h(AppLink, { to: `${ROUTE}/pipelines/${encodeURIComponent(p.pipeline)}` }, p.pipeline),
      p.description ? h(C.Text, { color: "fg.muted", fontSize: "xs" }, p.description) : null),
    Cell(null, h(AppLink, { to: `/dags/${encodeURIComponent(p.dag_id)}` }, p.dag_id)),
    ...(p.initialised ? [N(p.last_committed), N(p.next_txid), N(p.open),
      N(p.stuck ? h(C.Badge, { colorPalette: "failed", variant: "solid", size: "sm" }, String(p.stuck)) : "0"), N(num(p.lag)), N(num(p.backflow_waiting)),
      N(num(p.behind)), N(num(p.dead_letters)),
      Cell(null, p.last ? h(C.HStack, { gap: 1, whiteSpace: "nowrap" }, `txid ${p.last.txid}`, h(StateBadge, { state: p.last.state }),
        h(C.Text, { as: "span", color: "fg.muted" }, when(p.last.committed_at))) : "-")]
      : [Cell({ colSpan: 9, color: "fg.muted", className: "onceflow-not-initialised" }, p.error)])));
  return h(C.Box, null,
    h(C.HStack, { justify: "flex-end" },
      h(Toolbar, { every, setEvery, at: state.at, onRefresh: reload, error: state.data ? state.error : null })),
    h(C.Heading, { as: "h1", size: "lg", mb: 1 }, "Pipelines"),
    h(C.Text, { color: "fg.muted", fontSize: "sm", mb: 3 },
      "Exactly-once transactions of every registered pipeline, from onceflow's database."),
    state.error && !state.data ? h(ErrorBox, { id: "onceflow-error" }, state.error) : null,
    state.data ? h(Grid, { id: "onceflow-pipelines", empty: "No pipeline you may see is registered "
      + "(entry points of the group onceflow.pipelines, or ONCEFLOW_PIPELINES).",
    columns: [["pipeline"], ["DAG"], ["last committed", 1], ["next txid", 1], ["open", 1], ["stuck", 1],
      ["lag (source)", 1], ["backflow", 1], ["behind", 1], ["dead letters", 1], ["last commit"]],
    rows }) : h(C.Spinner, { size: "sm" }));
}

// -- the timeline ---------------------------------------------------------------------------------
function readFilter(search) {
  const int = (k) => { const v = search.get(k); return v && /^\d+$/.test(v) ? Number(v) : null; };
  const states = (search.get("state") || "").split(",").filter((s) => STATES.includes(s));
  const limit = int("limit");
  return { before: int("before"), after: int("after"), min: int("min"), max: int("max"),
    states, limit: limit >= 1 && limit <= PAGE_MAX ? limit : 50, txid: int("txid") };
}

function FilterForm({ filter, apply }) {
  const [min, setMin] = useState(filter.min ?? "");
  const [max, setMax] = useState(filter.max ?? "");
  const [states, setStates] = useState(filter.states);
  const [limit, setLimit] = useState(filter.limit);
  useEffect(() => { setMin(filter.min ?? ""); setMax(filter.max ?? ""); setStates(filter.states); setLimit(filter.limit); },
    [filter.min, filter.max, filter.states.join(","), filter.limit]);
  const toggle = (s) => setStates((old) => (old.includes(s) ? old.filter((x) => x !== s) : [...old, s]));
  const submit = (e) => { e.preventDefault(); apply({ min, max, states, limit }); };
  const box = (id, label, value, set) => h(C.Input, { id, size: "xs", width: "6.5rem", placeholder: label,
    "aria-label": label, inputMode: "numeric", value, onChange: (e) => set(e.target.value.replace(/\D/g, "")) });
  return h("form", { onSubmit: submit, id: "onceflow-filter" },
    h(C.HStack, { gap: 2, flexWrap: "wrap", fontSize: "sm", mb: 2 },
      h(C.Text, { as: "span", color: "fg.muted" }, "txids"),
      box("onceflow-min", "from txid", min, setMin), h(C.Text, { as: "span", color: "fg.muted" }, "to"),
      box("onceflow-max", "to txid", max, setMax),
      h(C.Text, { as: "span", color: "fg.muted", ml: 2 }, "states"),
      STATES.map((s) => h(C.Button, { key: s, size: "xs", type: "button", "aria-pressed": states.includes(s),
        variant: states.includes(s) ? "solid" : "outline", colorPalette: states.includes(s) ? PALETTE[s] : "gray",
        onClick: () => toggle(s), className: "onceflow-state-filter", "data-state": s }, s)),
      h(C.NativeSelect.Root, { size: "xs", width: "7rem" },
        h(C.NativeSelect.Field, { id: "onceflow-limit", "aria-label": "Transactions per page", value: String(limit),
          onChange: (e) => setLimit(Number(e.target.value)) },
        [...new Set([...PAGE_SIZES, limit])].sort((a, b) => a - b).map((n) =>
          h("option", { key: n, value: String(n) }, `${n} a page`))),
        h(C.NativeSelect.Indicator, null)),
      h(C.Button, { size: "xs", type: "submit", id: "onceflow-apply" }, "Apply"),
      h(C.Button, { size: "xs", variant: "ghost", type: "button", id: "onceflow-clear",
        onClick: () => apply({ min: "", max: "", states: [], limit }) }, "Clear")));
}

function Logs({ item }) {
  if (!item.run) return "-";
  return h(C.HStack, { gap: 2, flexWrap: "wrap", className: "onceflow-logs" },
    item.logs.map((l) => h(AppLink, { key: l.task, to: airflowPath(l.path), fontSize: "xs",
      "data-task": l.task, title: `the log of ${l.task} in run ${item.run_id}` }, l.task)));
}

function TimelineRow({ t, maxWait, highlight }) {
  const [open, setOpen] = useState(false);
  const earlier = t.attempts.length > 1;
  const row = h(C.Table.Row, { key: t.txid, "data-txid": t.txid, "data-state": t.state,
    bg: highlight ? "bg.info" : undefined, id: highlight ? "onceflow-highlight" : undefined },
  N(t.txid), N(t.attempt),
  Cell(null, h(StateBadge, { state: t.state }),
    t.reason && t.state !== "committed" ? h(C.Text, { fontSize: "xs", color: "fg.muted", maxW: "28rem",
      overflowWrap: "anywhere" }, t.reason) : null),
  N(num(t.records)), N(num(t.replayed)), N(num(t.failed)), N(num(t.rows_applied)),
  Cell({ whiteSpace: "nowrap" }, when(t.committed_at)),
  Cell({ whiteSpace: "nowrap", className: "wait" }, t.commit_wait_s === null ? "-" : h(C.HStack, { gap: 1 },
    t.commit_wait_s >= 0.05 ? h(C.Box, { as: "span", display: "inline-block", h: "0.6rem", bg: "orange.solid",
      rounded: "sm", w: `${Math.max(1, (60 * t.commit_wait_s) / (maxWait || 1)).toFixed(1)}px` }) : null,
    secs(t.commit_wait_s))),
  Cell({ color: "fg.muted", fontSize: "xs" }, t.ranges || "-"),
  Cell({ fontSize: "xs", maxW: "18rem", overflowWrap: "anywhere" },
    t.run ? h(AppLink, { to: airflowPath(t.run), className: "onceflow-run" }, t.run_id) : "-",
    earlier ? h(C.Button, { size: "2xs", variant: "ghost", ml: 1, onClick: () => setOpen(!open),
      "aria-expanded": open, className: "onceflow-attempts-toggle" }, `${open ? "▾" : "▸"} ${t.attempts.length} attempts`) : null),
  Cell(null, h(Logs, { item: t })));
  if (!open) return row;
  return [row, ...t.attempts.map((a) => h(C.Table.Row, { key: `${t.txid}-${a.attempt}`, className: "onceflow-attempt",
    "data-txid": t.txid, "data-attempt": a.attempt, bg: "bg.subtle" },
  Cell({ colSpan: 2, textAlign: "end", color: "fg.muted", fontSize: "xs" }, a.attempt === null ? "no-op run" : `attempt ${a.attempt}`),
  Cell(null, a.outcome ? h(StateBadge, { state: a.outcome }) : h(C.Text, { as: "span", fontSize: "xs" }, "current")),
  Cell({ colSpan: 7, fontSize: "xs", color: "fg.muted", overflowWrap: "anywhere" },
    a.attempt === null ? a.reason : `${when(a.started_at)} → ${when(a.ended_at)}${a.reason ? ` · ${a.reason}` : ""}`),
  Cell({ fontSize: "xs" }, a.run ? h(AppLink, { to: airflowPath(a.run) }, a.run_id) : "-"),
  Cell(null, h(Logs, { item: a }))))];
}

function Timeline({ timeline, filter, setSearch, error }) {
  const rows = timeline?.transactions || [];
  const maxWait = Math.max(0, ...rows.map((t) => t.commit_wait_s || 0));
  const page = (change) => setSearch((q) => {
    for (const k of ["before", "after", "txid"]) q.delete(k);
    for (const [k, v] of Object.entries(change)) q.set(k, String(v));
    return q;
  });
  const apply = ({ min, max, states, limit }) => setSearch((q) => {
    for (const k of ["before", "after", "txid", "min", "max", "state", "limit"]) q.delete(k);
    if (min !== "" && min !== null) q.set("min", String(min));
    if (max !== "" && max !== null) q.set("max", String(max));
    if (states.length) q.set("state", states.join(","));
    if (limit !== 50) q.set("limit", String(limit));
    return q;
  });
  const pinned = filter.before !== null || filter.after !== null || filter.txid !== null;
  const first = rows.length ? rows[0].txid : null;
  const lastTx = rows.length ? rows[rows.length - 1].txid : null;
  return h(C.Box, null,
    h(FilterForm, { filter, apply }),
    error ? h(ErrorBox, { id: "onceflow-timeline-error" }, error) : null,
    h(C.HStack, { gap: 2, mb: 2, fontSize: "sm" },
      h(C.Button, { size: "xs", variant: "outline", id: "onceflow-newest", disabled: !pinned,
        onClick: () => page({}) }, "Newest"),
      h(C.Button, { size: "xs", variant: "outline", id: "onceflow-newer", disabled: !timeline?.newer,
        onClick: () => page({ after: first }) }, "← Newer"),
      h(C.Button, { size: "xs", variant: "outline", id: "onceflow-older", disabled: !timeline?.older,
        onClick: () => page({ before: lastTx }) }, "Older →"),
      h(C.Text, { as: "span", color: "fg.muted", id: "onceflow-page" },
        rows.length ? `txids ${lastTx}–${first}${pinned ? "" : " (newest first; new ones appear as they are planned)"}` : "")),
    h(Grid, { id: "onceflow-timeline", empty: filter.min || filter.max || filter.states.length
      ? "No transaction matches this filter." : "No transaction yet: trigger the DAG.",
    columns: [["txid", 1], ["attempt", 1], ["state"], ["records", 1], ["replayed", 1], ["failed", 1],
      ["rows applied", 1], ["committed at (UTC)"], ["waited"], ["ranges"], ["run"], ["task logs"]],
    rows: rows.map((t) => h(TimelineRow, { key: t.txid, t, maxWait, highlight: t.txid === filter.txid })) }));
}

// -- one pipeline ---------------------------------------------------------------------------------
function PipelinePage({ name, every, setEvery }) {
  const [search, setSearchParams] = RR.useSearchParams();
  const navigate = RR.useNavigate();
  const filter = readFilter(search);
  const allDead = search.get("all_dead") === "1" || search.get("all_dead") === "true";
  const runId = search.get("run_id");
  const [last, setLast] = useState(200);
  const [flash, setFlash] = useState(null);
  const [ask, dialog] = useConfirm();
  const [runError, setRunError] = useState(null);
  const base = `/api/pipelines/${encodeURIComponent(name)}`;
  const setSearch = useCallback((change) => setSearchParams((old) => change(new URLSearchParams(old))), [setSearchParams]);

  // From an Airflow run (its "onceflow view" link): the run's txid, then the page at it.
  useEffect(() => {
    if (!runId) return;
    call(`${base}/txid${query({ run_id: runId })}`).then((found) => {
      setSearch((q) => { q.delete("run_id"); q.delete("before"); q.delete("after"); q.set("txid", String(found.txid)); return q; });
    }).catch((error) => setRunError(String(error.message || error)));
  }, [runId]); // eslint-disable-line react-hooks/exhaustive-deps

  const timelineQuery = query({
    before: filter.before ?? (filter.txid !== null && filter.after === null ? filter.txid + 1 : null),
    after: filter.after, min_txid: filter.min, max_txid: filter.max,
    state: filter.states.join(","), limit: filter.limit });
  const seriesQuery = query({ last, min_txid: filter.min, max_txid: filter.max });
  const [viewState, reloadView] = usePolled(() => call(`${base}${allDead ? "?all_dead=true" : ""}`), `${name}|${allDead}`, every);
  const [timelineState, reloadTimeline] = usePolled(() => call(`${base}/timeline${timelineQuery}`), `${name}|${timelineQuery}`, every);
  const [seriesState, reloadSeries] = usePolled(() => call(`${base}/series${seriesQuery}`), `${name}|${seriesQuery}`, every);
  const refresh = useCallback(() => { reloadView(); reloadTimeline(); reloadSeries(); }, [reloadView, reloadTimeline, reloadSeries]);

  const [busy, setBusy] = useState(false);
  const act = async (path, body, title) => {
    setBusy(true);
    try {
      const preview = await post(path, { ...body, confirm: false });
      const nothing = preview.count === 0 || (Array.isArray(preview.txids) && preview.txids.length === 0);
      if (nothing) { setFlash({ message: preview.message, error: false }); return; }
      if (!(await ask(title, preview.message))) return;
      const pinned = Array.isArray(preview.txids) ? { txids: preview.txids } : {};
      const done = await post(path, { ...body, ...pinned, confirm: true });
      setFlash({ message: done.message, error: false });
      refresh();
    } catch (error) {
      setFlash({ message: String(error.message || error), error: true });
    } finally {
      setBusy(false);
    }
  };
  // An action's button: a first POST says what would happen, the dialog asks, a second does it.
  const action = ({ path, body, title, id }, label) => h(C.Button, { size: "xs", variant: "outline",
    colorPalette: "red", id, className: "onceflow-action", "data-post": path, "data-body": JSON.stringify(body),
    disabled: busy, onClick: () => act(path, body, title) }, label);

  const p = viewState.data;
  const at = [viewState.at, timelineState.at, seriesState.at].filter(Boolean).sort((a, b) => b - a)[0];
  const lastError = viewState.error || timelineState.error || seriesState.error;
  const head = h(C.Box, null,
    h(C.HStack, { justify: "space-between", flexWrap: "wrap", gap: 2 },
      h(C.HStack, { gap: 2, fontSize: "sm" }, h(AppLink, { to: ROUTE }, "onceflow"), h(C.Text, { as: "span", color: "fg.muted" }, "/"),
        h(C.Text, { as: "span" }, name)),
      h(Toolbar, { every, setEvery, at, onRefresh: refresh, error: p ? lastError : null })),
    h(C.Heading, { as: "h1", size: "lg", mt: 2 }, name),
    p ? h(C.Text, { color: "fg.muted", fontSize: "sm" }, p.description ? `${p.description} · ` : "", p.source, " · DAG ",
      h(AppLink, { to: `/dags/${encodeURIComponent(p.dag_id)}`, id: "onceflow-dag" }, p.dag_id)) : null,
    h(Flash, { flash, onClose: () => setFlash(null) }),
    runError ? h(ErrorBox, { id: "onceflow-run-error" }, runError) : null,
    dialog);
  if (!p) {
    return h(C.Box, null, head, viewState.error ? h(ErrorBox, { id: "onceflow-error" }, viewState.error) : h(C.Spinner, { size: "sm", mt: 4 }));
  }
  if (!p.initialised) return h(C.Box, null, head, h(ErrorBox, { id: "onceflow-error" }, p.error));

  const stuck = p.open.filter((t) => t.stuck).length;
  const d = p.dead_letters;
  const approval = p.dead_letter_approval;
  const mayReplay = approval ? p.can_request_approval : p.can_operate;
  const replayPath = `${base}/dead-letters/${approval ? "request-approval" : "replay"}`;
  const replayLabel = approval ? "Ask for approval…" : "Replay…";
  const everyOne = (d.all || []).length > 0;  // asked for every dead letter (all_dead)
  const shown = everyOne ? d.all : d.newest || [];
  const f = p.freshness || {};
  const has = (k) => f[k] !== undefined && f[k] !== null;

  return h(C.Box, null, head,
    h(C.Wrap, { gap: 2, mt: 3, id: "onceflow-summary" },
      h(Card, { value: p.last_committed, label: "last committed txid", id: "onceflow-last-committed" }),
      h(Card, { value: p.next_txid, label: "next txid" }),
      h(Card, { value: p.open.length, label: "open txids", id: "onceflow-open-count" }),
      h(Card, { value: stuck, label: "stuck" }),
      h(Card, { value: num(p.lag), label: "records behind in the source (lag)", id: "onceflow-lag" }),
      has("lag_s") ? h(Card, { value: secs(f.lag_s), label: "behind in time (lag): how long the oldest waiting record has waited", id: "onceflow-lag-s" }) : null,
      has("p50_s") ? h(Card, { value: secs(f.p50_s), label: `freshness p50 (arrival to commit, last ${f.transactions} txids)`, id: "onceflow-freshness-p50" }) : null,
      has("p95_s") ? h(Card, { value: secs(f.p95_s), label: "freshness p95", id: "onceflow-freshness-p95" }) : null,
      h(Card, { value: num(p.backflow_waiting), label: "records waiting in the backflow", id: "onceflow-backflow-waiting" }),
      h(Card, { value: num(p.behind), label: "records not committed yet (both)", id: "onceflow-behind" }),
      h(Card, { value: num(d.total), label: "dead letters", id: "onceflow-dead-total" })),
    p.watcher ? h(Watcher, { watcher: p.watcher }) : null,

    h(Section, { title: "Over time", id: "onceflow-over-time" },
      seriesState.error && !seriesState.data ? h(ErrorBox, null, seriesState.error) : null,
      h(Charts, { series: seriesState.data, last, setLast })),

    h(Section, { title: "In flight and stuck", id: "onceflow-in-flight" },
      p.open.length ? h(Grid, { id: "onceflow-open",
        columns: [["txid", 1], ["state"], ["attempt", 1], ["run"], ["what holds it"], ["what frees it"], ["task logs"]],
        rows: p.open.map((t) => {
          const item = (timelineState.data?.transactions || []).find((x) => x.txid === t.txid);
          return h(C.Table.Row, { key: t.txid, "data-txid": t.txid },
            N(t.txid), Cell(null, h(StateBadge, { state: t.state })), N(t.attempt),
            Cell({ fontSize: "xs" }, t.run_id ? h(AppLink, { to: `/dags/${encodeURIComponent(p.dag_id)}/runs/${encodeURIComponent(t.run_id)}` }, t.run_id) : "-"),
            Cell({ fontSize: "sm", maxW: "32rem", overflowWrap: "anywhere" }, t.holds),
            Cell({ fontSize: "sm", maxW: "32rem", overflowWrap: "anywhere" }, t.fix),
            Cell(null, item ? h(Logs, { item }) : "-"));
        }) }) : h(Empty, null, "Nothing open: every planned transaction is committed."),
      p.can_operate && p.backfillable.length ? h(C.HStack, { mt: 2, gap: 2 },
        action({ id: "onceflow-backfill", path: `${base}/backfill`, body: { txids: p.backfillable },
          title: `Backfill ${name}` }, `Backfill ${p.backfillable.length} txid(s)…`),
        h(C.Text, { as: "span", color: "fg.muted", fontSize: "sm" }, "one DAG run per txid with conf {\"txid\": N}, in txid order")) : null),

    h(Section, { title: "Commit timeline", id: "onceflow-commits",
      sub: "Newest first; filter by txids and states, page through all of them. \"waited\": how long the commit waited for earlier txids to commit." },
    h(Timeline, { timeline: timelineState.data, filter, setSearch, error: timelineState.error })),

    h(Section, { title: "Partitions", id: "onceflow-partitions-section" },
      h(Grid, { id: "onceflow-partitions", empty: "no partitions yet",
        columns: [["partition", 1], ["log start", 1], ["head", 1], ["committed offset", 1], ["lag", 1]],
        rows: p.partitions.map((q) => h(C.Table.Row, { key: q.partition }, N(q.partition), N(num(q.log_start)),
          N(num(q.head)), N(num(q.committed)), N(num(q.lag)))) })),
    p.gaps.length ? h(Section, { title: "Gaps (records gone before they were read)", id: "onceflow-gaps-section" },
      h(Grid, { id: "onceflow-gaps", columns: [["partition", 1], ["range"], ["records", 1], ["txid", 1], ["policy"]],
        rows: p.gaps.map((g, i) => h(C.Table.Row, { key: i }, N(g.partition), Cell(null, `[${g.from}, ${g.to})`),
          N(num(g.to - g.from)), N(g.txid), Cell(null, g.policy))) })) : null,
    h(Section, { title: "Backflow", id: "onceflow-backflow-section" },
      h(Grid, { id: "onceflow-backflow", columns: [["queue"], ["items", 1], ["claimed by open txids", 1]],
        rows: [h(C.Table.Row, { key: "to" }, Cell(null, `to-queue (${p.backflow.to_queue}): replayed first by new transactions`),
          N(num(p.backflow.to_items)), N(num(p.backflow.to_claimed))),
        h(C.Table.Row, { key: "from" }, Cell(null, `from-queue (${1 - p.backflow.to_queue}): failed records waiting for the next swap`),
          N(num(p.backflow.from_items)), N("-"))] }),
      h(C.Text, { color: "fg.muted", fontSize: "sm", mt: 1 }, `${p.backflow.swaps} swap(s) so far.`)),

    h(Section, { title: "Dead letters", id: "onceflow-dead-section" },
      approval ? h(C.Text, { color: "fg.muted", fontSize: "sm", mb: 2, id: "onceflow-approval-note" },
        `Dead letters of ${name} are replayed only after a person approves: ${mayReplay ? "each button asks for it with" : "ask for it with"} a run of DAG `,
        h(AppLink, { to: `/dags/${encodeURIComponent(p.approval_dag_id)}` }, p.approval_dag_id),
        ", which shows the letters in Airflow's Required actions; nothing is replayed unless it is approved.") : null,
      d.total && d.fix && d.fix !== "-" ? h(C.Text, { color: "fg.muted", fontSize: "sm", mb: 2, id: "onceflow-dead-fix" },
        `What frees them: ${d.fix}.`) : null,
      d.total ? h(C.Box, null,
        h(Grid, { id: "onceflow-dead-reasons", columns: [["records", 1], ["last error"], ...(mayReplay ? [[""]] : [])],
          rows: d.by_reason.map((r, i) => h(C.Table.Row, { key: i }, N(num(r.count)),
            Cell({ className: "reason", title: r.reason, maxW: "40rem", overflowWrap: "anywhere", fontSize: "sm" },
              r.reason && r.reason.length > 160 ? `${r.reason.slice(0, r.reason.lastIndexOf(" ", 160) > 0 ? r.reason.lastIndexOf(" ", 160) : 160)}…` : (r.reason || "-")),
            mayReplay ? Cell(null, action({ path: replayPath, body: { last_error: r.reason },
              title: "Replay dead letters" }, replayLabel)) : null)) }),
        h(C.Heading, { as: "h3", size: "sm", mt: 4, mb: 1 }, everyOne ? "Every dead letter" : `Newest ${shown.length}`),
        h(Grid, { id: "onceflow-dead-letters", columns: [["record"], ["failures", 1], ["given up by txid", 1],
          ["last error"], ["dead since (UTC)"], ...(mayReplay ? [[""]] : [])],
        rows: shown.map((item) => h(C.Table.Row, { key: `${item.partition}:${item.offset}`, "data-record": `${item.partition}:${item.offset}` },
          Cell(null, `p${item.partition}:${item.offset}`), N(item.failures), N(item.txid),
          Cell({ fontSize: "sm", maxW: "36rem", overflowWrap: "anywhere" }, item.last_error), Cell({ whiteSpace: "nowrap" }, when(item.dead_at)),
          mayReplay ? Cell(null, action({ path: replayPath, body: { records: [`${item.partition}:${item.offset}`] },
            title: "Replay a dead letter" }, replayLabel)) : null)) }),
        !everyOne && d.total > shown.length ? h(C.Button, { size: "xs", variant: "ghost", mt: 1, id: "onceflow-all-dead",
          onClick: () => setSearch((q) => { q.set("all_dead", "1"); return q; }) }, `all ${num(d.total)} dead letters`) : null,
        mayReplay ? h(C.HStack, { mt: 2 }, action({ id: "onceflow-replay-all", path: replayPath, body: { all: true },
          title: "Replay every dead letter" }, approval ? `Ask for approval to replay all ${num(d.total)} dead letters…`
          : `Replay all ${num(d.total)} dead letters…`)) : null)
        : h(Empty, null, "No dead letters.")));
}

// -- the plugin's component -----------------------------------------------------------------------
export default function OnceflowView() {
  const location = RR.useLocation();
  const [every, setEvery] = useRefreshEvery();
  const rest = location.pathname.startsWith(ROUTE) ? location.pathname.slice(ROUTE.length) : "";
  const match = rest.match(/^\/pipelines\/([^/]+)\/?$/);
  const name = match ? decodeURIComponent(match[1]) : null;
  return h(C.Box, { id: "onceflow-view", p: 4, fontSize: "sm", color: "fg", "data-refresh": String(every) },
    name ? h(PipelinePage, { key: name, name, every, setEvery })
      : h(Overview, { every, setEvery }));
}

globalThis.AirflowPlugin = OnceflowView;
