# Copyright (c) 2026 The authors of this repository. SPDX-License-Identifier: MIT (see LICENSE).
"""Where a run's time went: its spans, a trace for Perfetto, a Gantt chart, and learning curves.

`Spans` times every phase of a rank through one helper: `with spans("train"): ...` records (name,
start, end, args), args being the step and policy version the caller set. A run of train_grpo.py
leaves in its folder one spans_rank<N>.jsonl per rank (every timed phase: {"rank", "name", "start",
"end", "step", "version"}, in seconds since the run started) and metrics.jsonl (one object per
step). From them this module writes, standard library only:
  trace.json     Chrome trace-event format, one track per rank: open it in ui.perfetto.dev or
                 chrome://tracing
  timeline.svg   a Gantt chart of 3 steps, one row per rank, one colour per phase; white gaps are
                 time in which no phase was open, grey hatched bars are waits (queue, idle); hover a
                 bar for its step
  curves.svg     held-out accuracy, mean reward and the yield of kept groups against wall time, a
                 line per run

    python -m plumbing.timeline runs/RUN                            # the three files, into runs/RUN
    python -m plumbing.timeline runs/RUN --first-step 10 --steps 2  # the chart: steps 10 and 11
    python -m plumbing.timeline runs/A runs/B --out curves.svg --labels S0,S1  # runs compared
    python -m plumbing.timeline --help

Contents: Spans and DeviceClock (recording), load_spans, check_nesting, trace_events / write_trace,
pick_window, write_timeline_svg, load_metrics, curve_points, write_curves_svg, write_all, main.
"""
import argparse
import json
import math
import os
import time
from contextlib import contextmanager
from xml.sax.saxutils import escape, quoteattr

# Phase -> (fill, hatched). Okabe-Ito and Paul Tol colours, readable under the common colour
# blindnesses; waits are grey and hatched so that they read as "nothing useful happening" next to
# the white gaps.
PHASES = {
    "warmup": ("#332288", False),             # indigo
    "switch_to_rollout": ("#E69F00", False),  # orange
    "rollout": ("#0072B2", False),            # blue
    "idle": ("#E0E0E0", True),                # light grey, hatched: waiting for the peers' rollouts
    "switch_to_train": ("#D55E00", False),    # vermillion (the other switch)
    "score": ("#44AA99", False),              # teal
    "queue": ("#B0B0B0", True),               # grey, hatched: waiting for samples
    "reference": ("#AA4499", False),          # purple
    "train": ("#228833", False),              # green
    "push": ("#8C510A", False),               # brown
    "recv": ("#BF812D", False),               # light brown
    "eval": ("#F0E442", False),               # yellow
}
FALLBACK = ("#CC6677", False)                 # rose, for a phase not listed above
RUN_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000",
               "#F0E442"]
WIDTH = 1000


# --- recording -------------------------------------------------------------------------------

class Spans:
    """Records every timed phase as (name, start, end, args); spans named in `idle` count as
    waiting. args: a copy of `self.args` when the span began (the caller sets e.g. the step and
    policy version there), so that a timeline can say what each span belonged to.
    device: on an accelerator (CUDA, XPU, ...), work runs behind the host: each span also leaves a
    mark on the device's stream at its start and end (DeviceClock), and settle() moves each bound to
    when the device reached it, if that was later. settle() waits for the device once for every
    span since the last one (total() and the run's log call it once per step): spans never
    serialise the device's work on the host."""

    def __init__(self, idle=("idle",), device=None, clock=None):
        self.spans, self.idle, self.t0, self.args = [], set(idle), time.perf_counter(), {}
        accelerated = device is not None and str(device).split(":")[0] not in ("cpu", "meta")
        if clock is None and accelerated:
            clock = DeviceClock(device)
        self.clock = clock  # None: host only
        # (index in spans, start mark, end mark): spans whose device times are not read yet
        self.pending = []
        self.open, self.failed_in = [], None  # the spans running now; where the first error struck

    @contextmanager
    def __call__(self, name):
        t0, args = time.perf_counter(), dict(self.args)
        start = self.clock.mark() if self.clock is not None else None
        self.open.append(name)
        try:
            yield
        except BaseException:
            self.failed_in = self.failed_in or (" > ".join(self.open), args)
            raise
        finally:
            self.open.pop()
            if self.clock is not None:
                self.pending.append((len(self.spans), start, self.clock.mark()))
            self.spans.append((name, t0, time.perf_counter(), args))
            # a loop that never reads its spans still waits once in a while
            if len(self.pending) > 1024:
                self.settle()

    def settle(self):
        """Each pending span's start and end: the later of the host's time and the device's."""
        if not self.pending:
            return
        marks = [m for _, start, end in self.pending for m in (start, end)]
        at = self.clock.times(marks)  # host seconds
        for j, (i, _, _) in enumerate(self.pending):
            name, t0, t1, args = self.spans[i]
            self.spans[i] = (name, max(t0, at[2 * j]), max(t1, at[2 * j + 1]), args)
        self.pending.clear()

    def total(self, names, since=0):
        """Seconds spent in spans called `names` (a name or a tuple), from span index `since`."""
        self.settle()
        names = (names,) if isinstance(names, str) else tuple(names)
        return sum(t1 - t0 for n, t0, t1, _ in self.spans[since:] if n in names)

    def perf(self, tokens, since_t=None):
        """perf/tokens_per_s and perf/idle_frac over the wall time since since_t (or creation)."""
        self.settle()
        t0 = self.t0 if since_t is None else since_t
        wall = max(time.perf_counter() - t0, 1e-9)
        now = time.perf_counter()
        idle = sum(min(b, now) - max(a, t0)
                   for n, a, b, _ in self.spans if n in self.idle and b > t0)
        return {"perf/tokens_per_s": tokens / wall, "perf/idle_frac": idle / wall}


class DeviceClock:
    """Marks on an accelerator's current stream (timing events), read back as host perf_counter
    seconds: times(marks) records one more event, waits for it and for each mark (a mark may sit on
    another stream), and counts each mark back from it by the device's own elapsed time. The events:
    torch.Event on the stream of torch.accelerator.current_stream (torch >= 2.6, any accelerator
    whose backend times events), else torch.cuda's (older torch: CUDA only); mark() is the one place
    this file names either."""

    def __init__(self, device):
        # only on an accelerator: this file needs nothing but the standard library otherwise
        import torch
        self.torch, self.device = torch, torch.device(device)

    def mark(self):
        torch = self.torch
        if hasattr(torch, "accelerator") and hasattr(torch, "Event"):  # torch >= 2.6
            event = torch.Event(device=self.device, enable_timing=True)
            event.record(torch.accelerator.current_stream(self.device))
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
        return event

    def times(self, marks):
        last = self.mark()
        # a mark may sit on another stream (a span inside FSDP's hooks): wait for each
        for m in (*marks, last):
            m.synchronize()
        now = time.perf_counter()
        return [now - m.elapsed_time(last) / 1000 for m in marks]


# --- spans ------------------------------------------------------------------------------------

def load_spans(out_dir):
    """Every rank's spans from out_dir/spans_rank<N>.jsonl, by rank, then start (outer first)."""
    spans = []
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith("spans_rank") and name.endswith(".jsonl")):
            continue
        rank = int(name[len("spans_rank"):-len(".jsonl")])
        with open(os.path.join(out_dir, name)) as f:
            for line in f:
                if line.strip():
                    span = json.loads(line)
                    span.setdefault("rank", rank)
                    spans.append(span)
    return sorted(spans, key=_order)


def _order(span):
    """Rank, start, and the longer (outer) span first when two start together."""
    return span["rank"], span["start"], -span["end"]


def _describe(span):
    return f"{span['name']!r} [{span['start']:.6f}, {span['end']:.6f}] (step {span.get('step')})"


def nesting(spans):
    """(span, depth) for every span, rank by rank: 0 for a top-level span, 1 for one inside it, and
    so on. Raises ValueError naming the rank and both spans where two spans of one rank overlap with
    neither inside the other. A span that starts exactly where another ends does not overlap it."""
    out = []
    for rank in sorted({s["rank"] for s in spans}):
        stack = []  # the spans open at the current start, outermost first
        for span in sorted((s for s in spans if s["rank"] == rank), key=_order):
            while stack and stack[-1]["end"] <= span["start"]:
                stack.pop()                                 # ended before this one began
            if stack and span["end"] > stack[-1]["end"]:
                raise ValueError(f"rank {rank}: spans {_describe(stack[-1])} and {_describe(span)} "
                                 f"overlap, and neither is nested in the other")
            out.append((span, len(stack)))
            stack.append(span)
    return out


def check_nesting(spans):
    """Raises ValueError (naming the rank and both spans) if two spans of one rank overlap badly."""
    nesting(spans)


# --- trace.json -------------------------------------------------------------------------------

def trace_events(spans):
    """Chrome trace-event JSON (object format): one process "ranks", one thread (track) per rank,
    one complete event ("X") per span, times in whole microseconds (integers, so that a nested
    span's end never passes its parent's by a rounding)."""
    events = [{"name": "process_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0,
               "args": {"name": "ranks"}}]
    for rank in sorted({s["rank"] for s in spans}):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
    for s in sorted(spans, key=_order):                     # parents before their children
        ts = round(s["start"] * 1e6)
        end = round(s["end"] * 1e6)
        args = {k: s[k] for k in ("step", "version") if s.get(k) is not None}
        events.append({"name": s["name"], "cat": s["name"], "ph": "X", "ts": ts, "dur": end - ts,
                       "pid": 0, "tid": s["rank"], "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(out_dir, spans):
    """Writes out_dir/trace.json; returns its path."""
    path = os.path.join(out_dir, "trace.json")
    with open(path, "w") as f:
        json.dump(trace_events(spans), f)
    return path


# --- SVG helpers ------------------------------------------------------------------------------

def _svg(width, height, body):
    """A whole SVG document from its body (a list of element strings)."""
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" '
            'font-family="Helvetica, Arial, sans-serif" font-size="12">')
    background = (f'<rect class="background" x="0" y="0" width="{width}" height="{height}" '
                  'fill="white"/>')
    return "\n".join([head, background, *body, "</svg>"]) + "\n"


def _text(x, y, s, anchor="start", size=12, cls="label", fill="#222", weight="normal"):
    return (f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" '
            f'font-size="{size}" fill="{fill}" font-weight="{weight}">{escape(str(s))}</text>')


def _line(x1, y1, x2, y2, stroke="#888", width=1, dash=None):
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
            f'stroke-width="{width}"{extra}/>')


def _write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def nice_ticks(lo, hi, target=8):
    """Round tick values (1, 2 or 5 times a power of ten apart) inside [lo, hi], about `target` of
    them; and their spacing."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    k = math.ceil(lo / step - 1e-9)
    ticks = []
    while k * step <= hi + step * 1e-9:
        ticks.append(k * step)
        k += 1
    return ticks, step


def tick_label(value, step):
    """A tick's text with just the decimals its spacing needs."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f}"


def _fill(name):
    """The SVG fill of a phase: its colour, or its hatch pattern."""
    colour, hatched = PHASES.get(name, FALLBACK)
    return f"url(#hatch-{name})" if hatched else colour


def _hatch_defs():
    """One diagonal-hatch pattern per hatched phase (its grey, with darker stripes)."""
    out = ["<defs>"]
    for name, (colour, hatched) in PHASES.items():
        if hatched:
            out.append(f'<pattern id="hatch-{name}" patternUnits="userSpaceOnUse" '
                       'width="6" height="6" patternTransform="rotate(45)">'
                       f'<rect width="6" height="6" fill="{colour}"/>'
                       '<line x1="0" y1="0" x2="0" y2="6" stroke="#6E6E6E" stroke-width="2"/>'
                       '</pattern>')
    out.append("</defs>")
    return out


# --- timeline.svg -----------------------------------------------------------------------------

def pick_window(spans, first_step=None, n_steps=3):
    """(t0, t1, first, last): the time from the first span of step `first` to the end of the last
    span of steps first..first+n_steps-1 (`last`: the highest of them present). first_step defaults
    to the first step >= 2 (the first steps carry warm-up effects), else the earliest. Without step
    numbers: every span."""
    steps = sorted({s["step"] for s in spans if s.get("step") is not None})
    if not steps:
        return min(s["start"] for s in spans), max(s["end"] for s in spans), None, None
    if first_step is None:
        first_step = next((k for k in steps if k >= 2), steps[0])
    last_step = first_step + n_steps - 1
    inside = [s for s in spans
              if s.get("step") is not None and first_step <= s["step"] <= last_step]
    if not inside:
        raise ValueError(f"no spans of steps {first_step}..{last_step}; "
                         f"the run has steps {steps[0]}..{steps[-1]}")
    firsts = [s for s in inside if s["step"] == first_step] or inside
    t0 = min(s["start"] for s in firsts)
    t1 = max(s["end"] for s in inside)
    return t0, t1, first_step, max(s["step"] for s in inside)


def window_spans(spans, t0, t1):
    """The spans drawn in the window [t0, t1]: those overlapping it (touching an edge is not)."""
    return [s for s in spans if s["end"] > t0 and s["start"] < t1]


def _span_title(s):
    """A span's hover text: phase, duration, step, version, rank and times."""
    dur = s["end"] - s["start"]
    dur_text = f"{dur * 1e3:.1f} ms" if dur < 1 else f"{dur:.3f} s"
    return (f"{s['name']}: {dur_text} | step {s.get('step')} | version {s.get('version')} | "
            f"rank {s['rank']} | {s['start']:.3f}-{s['end']:.3f} s")


def _bars(drawn, x_of, row_y, row_h):
    """One <rect class="span"> per span, clipped to the window, nested ones on top and thinner."""
    out = []
    for s, depth in sorted(nesting(drawn), key=lambda sd: sd[1]):  # outer spans first, inner on top
        inset = min(depth, 3) * row_h * 0.2
        x0, x1 = x_of(s["start"]), x_of(s["end"])
        width = max(x1 - x0, 0.8)  # a very short span stays visible
        # white is for gaps only
        edge = 'stroke="#1A1A1A" stroke-width="0.6"' if depth else 'stroke="none"'
        y = row_y[s["rank"]] + inset
        height = row_h - 2 * inset
        out.append(f'<rect class="span" data-phase={quoteattr(s["name"])} x="{x0:.2f}" '
                   f'y="{y:.2f}" width="{width:.2f}" height="{height:.2f}" '
                   f'fill="{_fill(s["name"])}" {edge}>'
                   f'<title>{escape(_span_title(s))}</title></rect>')
    return out


def _legend(names, y, left, right, gap_entry=True):
    """Swatch and name for each phase, wrapping at the right edge: (elements, the y below)."""
    out, x = [], left
    items = [(n, _fill(n)) for n in names]
    if gap_entry:
        items.append(("gap: no phase open", "white"))
    for name, fill in items:
        item_w = 20 + 6.2 * len(name) + 16
        if x + item_w > right and x > left:
            x, y = left, y + 20
        out.append(f'<rect class="swatch" x="{x:.1f}" y="{y - 10:.1f}" width="14" height="14" '
                   f'fill="{fill}" stroke="#555" stroke-width="0.6"/>')
        out.append(_text(x + 20, y + 1, name, cls="legend"))
        x += item_w
    return out, y + 20


def _phase_order(names):
    """Phases in PHASES order, then any unknown ones alphabetically."""
    known = [n for n in PHASES if n in names]
    return known + sorted(set(names) - set(PHASES))


def _time_axis(t0, t1, x_of, y):
    """Ticks in seconds below the rows at height y, with round spacing, and the axis label."""
    ticks, step = nice_ticks(t0, t1, target=8)
    out = [_line(x_of(t0), y, x_of(t1), y, stroke="#444")]
    for t in ticks:
        out.append(_line(x_of(t), y, x_of(t), y + 5, stroke="#444"))
        out.append(_text(x_of(t), y + 18, tick_label(t, step), anchor="middle", cls="tick"))
    middle = (x_of(t0) + x_of(t1)) / 2
    out.append(_text(middle, y + 36, "seconds since the run started", anchor="middle"))
    return out


def write_timeline_svg(out_dir, spans, first_step=None, n_steps=3, path=None):
    """A Gantt chart of n_steps steps from first_step (see pick_window): one row per rank, one
    colour per phase, nested spans thinner on top of their parent, white gaps where no span is open.
    Returns the path."""
    path = path or os.path.join(out_dir, "timeline.svg")
    folder = os.path.basename(os.path.normpath(out_dir))
    if not spans:
        empty = [_text(20, 45, f"{folder}: no spans recorded", size=15)]
        return _write(path, _svg(WIDTH, 80, empty))
    t0, t1, first, last = pick_window(spans, first_step, n_steps)
    drawn = window_spans(spans, t0, t1)
    ranks = sorted({s["rank"] for s in spans})
    left, right, top, row_h, row_gap = 70, WIDTH - 20, 62, 26, 14
    scale = (right - left) / max(t1 - t0, 1e-9)

    def x_of(t):                                            # seconds -> x, clipped to the window
        return left + (min(max(t, t0), t1) - t0) * scale

    row_y = {r: top + i * (row_h + row_gap) for i, r in enumerate(ranks)}
    steps = f"steps {first}-{last}" if first is not None and last != first else f"step {first}"
    title = f"{folder}: {steps}" if first is not None else f"{folder}: every span (no step numbers)"
    subtitle = (f"{t1 - t0:.3f} s shown; white = no phase open, grey hatched = waiting; "
                "hover a bar for its step and version")
    body = _hatch_defs() + [_text(left, 24, title, size=15, weight="bold", cls="title"),
                            _text(left, 42, subtitle, fill="#555")]
    for r in ranks:  # row label and baseline (visible in the gaps)
        label_y = row_y[r] + row_h / 2 + 4
        base_y = row_y[r] + row_h - 0.5
        body.append(_text(left - 10, label_y, f"rank {r}", anchor="end", cls="rank"))
        body.append(_line(left, base_y, right, base_y, stroke="#777"))
    body += _bars(drawn, x_of, row_y, row_h)
    axis_y = top + len(ranks) * (row_h + row_gap) - row_gap + 6
    body += _time_axis(t0, t1, x_of, axis_y)
    legend, bottom = _legend(_phase_order({s["name"] for s in drawn}), axis_y + 62, left, right)
    body += legend
    return _write(path, _svg(WIDTH, int(bottom + 4), body))


# --- curves.svg -------------------------------------------------------------------------------

CURVES = [("eval/accuracy", "held-out accuracy"), ("reward/mean", "mean reward"),
          ("rollout/yield", "groups kept / generated")]


def load_metrics(run_dir):
    """The records of run_dir/metrics.jsonl ([] when there is none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve_points(records):
    """{key: [(wall_s, value), ...]} for each key of CURVES: a step's wall time is the sum of
    time/step_s up to and including it (step 0, the warm-up's evaluation, at 0). Missing, null or
    NaN values are skipped."""
    points, wall = {key: [] for key, _ in CURVES}, 0.0
    for rec in records:
        wall += rec.get("time/step_s") or 0.0
        for key in points:
            v = rec.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                points[key].append((wall, float(v)))
    return points


def nice_range(values, target=6):
    """(lo, hi, ticks, step): an axis range that holds `values`, widened to round ticks."""
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12:  # one value, or all equal: give it some room
        pad = abs(lo) * 0.1 or 0.5
        lo, hi = lo - pad, hi + pad
    _, step = nice_ticks(lo, hi, target)
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks, _ = nice_ticks(lo, hi, round((hi - lo) / step))
    return lo, hi, ticks, step


def _axes(box, xr, yr, title, x_label):
    """A panel's frame, grid lines, ticks, tick labels, title and x label. box: (x, y, w, h)."""
    x, y, w, h = box
    (xlo, xhi, xticks, xstep), (ylo, yhi, yticks, ystep) = xr, yr
    out = [f'<rect class="frame" x="{x}" y="{y}" width="{w}" height="{h}" '
           'fill="none" stroke="#444"/>']
    for t in xticks:
        px = x + (t - xlo) / (xhi - xlo) * w
        out += [_line(px, y, px, y + h, stroke="#E6E6E6"),
                _line(px, y + h, px, y + h + 5, stroke="#444"),
                _text(px, y + h + 18, tick_label(t, xstep), anchor="middle", cls="tick")]
    for t in yticks:
        py = y + h - (t - ylo) / (yhi - ylo) * h
        out += [_line(x, py, x + w, py, stroke="#E6E6E6"),
                _line(x - 5, py, x, py, stroke="#444"),
                _text(x - 8, py + 4, tick_label(t, ystep), anchor="end", cls="tick")]
    out.append(_text(x + w / 2, y - 10, title, anchor="middle", size=13, weight="bold"))
    out.append(_text(x + w / 2, y + h + 36, x_label, anchor="middle"))
    return out


def _panel(box, key, title, runs, colours):
    """One panel: every run's polyline of `key` against wall time (one per run, empty if it has no
    points), with a marker on each evaluation of the accuracy."""
    x, y, w, h = box
    all_pts = [p for pts in runs for p in pts[key]]
    xr = nice_range([0.0] + [p[0] for p in all_pts])
    yr = nice_range([p[1] for p in all_pts])
    out = _axes(box, xr, yr, title, "wall time (s)")
    if not all_pts:
        out.append(_text(x + w / 2, y + h / 2, "no data", anchor="middle", fill="#888"))

    def xy(p):
        px = x + (p[0] - xr[0]) / (xr[1] - xr[0]) * w
        py = y + h - (p[1] - yr[0]) / (yr[1] - yr[0]) * h
        return px, py

    for pts, colour in zip(runs, colours):
        coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in map(xy, pts[key]))
        out.append(f'<polyline class="curve" data-key="{key}" points="{coords}" fill="none" '
                   f'stroke="{colour}" stroke-width="1.8" stroke-linejoin="round"/>')
        if key == "eval/accuracy":                          # every point is an evaluation
            out += [f'<circle class="marker" cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{colour}" '
                    f'stroke="white" stroke-width="0.8"/>' for px, py in map(xy, pts[key])]
    return out


def write_curves_svg(paths, out_path, labels=None):
    """Held-out accuracy, mean reward and dynamic sampling's yield against wall time, a panel for
    each side by side, one line per run folder in `paths` (labelled by `labels`, default the
    folders' names). Returns out_path."""
    labels = list(labels) if labels else [os.path.basename(os.path.normpath(p)) for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} runs")
    runs = [curve_points(load_metrics(p)) for p in paths]
    colours = [RUN_COLOURS[i % len(RUN_COLOURS)] for i in range(len(paths))]
    if len(labels) <= 3:
        title = "learning curves: " + ", ".join(labels)
    else:
        title = f"learning curves of {len(labels)} runs"
    body = [_text(60, 24, title, size=15, weight="bold", cls="title")]
    x, y = 60, 45
    for label, colour in zip(labels, colours):  # the legend: a short line and the label per run
        item_w = 28 + 7 * len(label) + 24
        if x + item_w > WIDTH - 20 and x > 60:              # wrap onto another line
            x, y = 60, y + 18
        body.append(_line(x, y, x + 22, y, stroke=colour, width=3))
        body.append(_text(x + 28, y + 4, label, cls="legend"))
        x += item_w
    panel_w = (WIDTH - 80) / len(CURVES) - 60                # a gap of 60 for each panel's y labels
    for i, (key, name) in enumerate(CURVES):
        body += _panel((60 + i * (panel_w + 60), y + 45, panel_w, 260), key, name, runs, colours)
    return _write(out_path, _svg(WIDTH, int(y + 355), body))


# --- one run, and the command line ------------------------------------------------------------

def write_all(out_dir, first_step=None, n_steps=3, curves_path=None, labels=None):
    """trace.json, timeline.svg and (when the run has a metrics.jsonl) curves.svg, into out_dir; the
    spans are checked for improper overlaps first (ValueError). Returns the paths written."""
    spans = load_spans(out_dir)
    check_nesting(spans)
    paths = [write_trace(out_dir, spans), write_timeline_svg(out_dir, spans, first_step, n_steps)]
    if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        curves_path = curves_path or os.path.join(out_dir, "curves.svg")
        paths.append(write_curves_svg([out_dir], curves_path, labels))
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m plumbing.timeline",
                                description=__doc__.split("\n")[0],
                                epilog="One RUN_DIR: trace.json, timeline.svg and curves.svg "
                                       "into it. Several: one curves.svg comparing them (--out), "
                                       "their folders left alone.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a folder written by train_grpo.py")
    p.add_argument("--out", help="the curves' SVG (default: RUN_DIR/curves.svg for one run, "
                                 "./curves.svg for several)")
    p.add_argument("--labels", help="comma-separated names of the runs in the curves' legend")
    p.add_argument("--first-step", type=int,
                   help="the timeline's first step (default: the first >= 2)")
    p.add_argument("--steps", type=int, default=3, help="how many steps the timeline shows")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.runs):
        p.error(f"--labels names {len(labels)} runs, but {len(args.runs)} RUN_DIRs were given")
    try:
        if len(args.runs) == 1:
            paths = write_all(args.runs[0], args.first_step, args.steps, args.out, labels)
        else:
            paths = [write_curves_svg(args.runs, args.out or "curves.svg", labels)]
    except (ValueError, OSError) as e:
        p.exit(1, f"timeline: {e}\n")
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
