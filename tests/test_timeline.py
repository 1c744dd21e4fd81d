"""timeline.py on synthetic run folders: the trace, the nesting check, the Gantt chart, the curves, the CLI."""
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from plumbing import timeline as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = "{http://www.w3.org/2000/svg}"


def make_spans(steps=5):
    """Two ranks: a warm-up without a step, then per step a switch, a rollout (rank 0 done early and idle,
    nested, to its end), a switch back, the score, a 4 ms gap with no span open, the queue, training."""
    spans = [{"rank": r, "name": "warmup", "start": 0.0, "end": 1.0} for r in (0, 1)]
    t = 1.5
    for k in range(1, steps + 1):
        for r in (0, 1):
            def add(name, a, b):
                spans.append({"rank": r, "name": name, "start": t + a, "end": t + b, "step": k, "version": k - 1})
            add("switch_to_rollout", 0.0, 0.02)
            add("rollout", 0.02, 0.11)
            if r == 0:
                add("idle", 0.08, 0.11)
            add("switch_to_train", 0.11, 0.115)
            add("score", 0.115, 0.118)
            add("queue", 0.122, 0.124)           # after the gap 0.118..0.122
            add("train", 0.124, 0.234)
        t += 0.25
    return spans


def write_run(folder, spans, metrics=None, steps=5):
    """A run folder: spans_rank<N>.jsonl per rank and metrics.jsonl (an evaluation at steps 0 and 3)."""
    os.makedirs(folder, exist_ok=True)
    for r in sorted({s["rank"] for s in spans}):
        with open(os.path.join(folder, f"spans_rank{r}.jsonl"), "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in spans if s["rank"] == r)
    if metrics is None:
        metrics = [{"step": 0, "eval/accuracy": 0.77}]
        for k in range(1, steps + 1):
            rec = {"step": k, "reward/mean": 0.5 + 0.05 * k, "time/step_s": 0.25}
            metrics.append({**rec, "eval/accuracy": 0.8} if k == 3 else rec)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
    return str(folder)


def svg_root(path):
    return ET.parse(path).getroot()


def span_rects(root):
    return [e for e in root.iter(NS + "rect") if e.get("class") == "span"]


# --- loading and nesting ------------------------------------------------------------------------

def test_load_spans_reads_every_rank(tmp_path):
    spans = make_spans()
    out = write_run(tmp_path / "run", spans)
    loaded = T.load_spans(out)
    assert len(loaded) == len(spans) and {s["rank"] for s in loaded} == {0, 1}
    T.check_nesting(loaded)                       # the synthetic run nests properly


def test_improper_overlap_is_named(tmp_path):
    # rank 1's push starts inside its train of step 1 (1.624..1.734) and ends after it
    spans = make_spans(2) + [{"rank": 1, "name": "push", "start": 1.70, "end": 1.80, "step": 1}]
    with pytest.raises(ValueError) as e:
        T.check_nesting(spans)
    msg = str(e.value)
    assert "rank 1" in msg and "'push'" in msg and "'train'" in msg
    out = write_run(tmp_path / "bad", spans)
    with pytest.raises(ValueError, match="rank 1"):
        T.write_all(out)


def test_nesting_depths():
    spans = make_spans(1)
    depth = {(s["rank"], s["name"]): d for s, d in T.nesting(spans)}
    assert depth[(0, "idle")] == 1 and depth[(0, "rollout")] == 0 and depth[(1, "train")] == 0


# --- trace.json ---------------------------------------------------------------------------------

def test_trace_has_one_labelled_track_per_rank(tmp_path):
    spans = make_spans()
    out = write_run(tmp_path / "run", spans)
    paths = T.write_all(out)
    trace = json.load(open(os.path.join(out, "trace.json")))
    assert os.path.join(out, "trace.json") in paths and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e)
        assert e["ph"] in ("X", "M") and ("dur" in e) == (e["ph"] == "X")
    xs = [e for e in events if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"} and {e["tid"] for e in xs} == {0, 1}
    assert any(e["name"] == "process_name" for e in events)
    assert len(xs) == len(spans)
    for e, s in zip(xs, sorted(spans, key=lambda s: (s["rank"], s["start"], -s["end"]))):
        assert (e["name"], e["cat"], e["tid"]) == (s["name"], s["name"], s["rank"])
        assert abs(e["ts"] - s["start"] * 1e6) <= 0.5 and abs(e["ts"] + e["dur"] - s["end"] * 1e6) <= 0.5
        assert e["args"] == {k: s[k] for k in ("step", "version") if k in s}
    # the trace's own spans nest as the input did
    T.check_nesting([{"rank": e["tid"], "name": e["name"], "start": e["ts"], "end": e["ts"] + e["dur"]} for e in xs])


# --- timeline.svg -------------------------------------------------------------------------------

def expected_window(spans, first, n):
    """The chart's window and its spans, computed here from the input."""
    t0 = min(s["start"] for s in spans if s.get("step") == first)
    t1 = max(s["end"] for s in spans if s.get("step") is not None and first <= s["step"] < first + n)
    return [s for s in spans if s["end"] > t0 and s["start"] < t1]


@pytest.mark.parametrize("first, n, expect_first", [(None, 3, 2), (1, 1, 1), (4, 3, 4)])
def test_timeline_draws_one_rect_per_span_in_the_window(tmp_path, first, n, expect_first):
    spans = make_spans()
    path = T.write_timeline_svg(str(tmp_path), spans, first_step=first, n_steps=n)
    root = svg_root(path)
    drawn = expected_window(spans, expect_first, n)
    rects = span_rects(root)
    assert len(rects) == len(drawn) > 0
    for r in rects:
        title = r.find(NS + "title").text
        assert "ms" in title and "step" in title and "version" in title
    texts = [e.text for e in root.iter(NS + "text")]
    legend = {e.text for e in root.iter(NS + "text") if e.get("class") == "legend"}
    assert {s["name"] for s in drawn} <= legend and "warmup" not in legend
    assert "rank 0" in texts and "rank 1" in texts
    assert any(f"step{'s' if n > 1 else ''} {expect_first}" in (t or "") for t in texts)


def test_timeline_without_steps_or_spans(tmp_path):
    spans = [{k: v for k, v in s.items() if k not in ("step", "version")} for s in make_spans(2)]
    root = svg_root(T.write_timeline_svg(str(tmp_path), spans))
    assert len(span_rects(root)) == len(spans)    # every span, warm-up included
    root = svg_root(T.write_timeline_svg(str(tmp_path), [], path=str(tmp_path / "empty.svg")))
    assert span_rects(root) == []


def test_nice_ticks_are_round():
    ticks, step = T.nice_ticks(5.25, 5.98)
    assert step == pytest.approx(0.1) and [T.tick_label(t, step) for t in ticks][:2] == ["5.3", "5.4"]
    ticks, step = T.nice_ticks(0, 11, 6)
    assert step == 2 and ticks[-1] == 10


# --- curves and write_all ----------------------------------------------------------------------

def polylines(root):
    return [e for e in root.iter(NS + "polyline") if e.get("class") == "curve"]


def test_curves_one_line_per_run_and_panel(tmp_path):
    a = write_run(tmp_path / "a", make_spans())
    b = write_run(tmp_path / "b", make_spans(1), metrics=[{"step": 0, "eval/accuracy": None},
                                                         {"step": 1, "reward/mean": 0.4, "time/step_s": 0.3}])
    root = svg_root(T.write_curves_svg([a, b], str(tmp_path / "c.svg"), labels=["first", "second"]))
    lines = polylines(root)
    assert sorted(e.get("data-key") for e in lines) == ["eval/accuracy"] * 2 + ["reward/mean"] * 2 + \
        ["rollout/yield"] * 2
    legend = {e.text for e in root.iter(NS + "text") if e.get("class") == "legend"}
    assert legend == {"first", "second"}
    acc_a = lines[0].get("points").split()
    assert len(acc_a) == 2                        # run a evaluated at steps 0 and 3
    points = T.curve_points(T.load_metrics(a))
    assert points["eval/accuracy"] == [(0.0, 0.77), (0.75, 0.8)] and len(points["reward/mean"]) == 5


def test_write_all_survives_a_thin_run(tmp_path):
    out = write_run(tmp_path / "thin", [], metrics=[{"step": 0, "eval/accuracy": 0.5},
                                                    {"step": 1, "reward/mean": 0.1, "time/step_s": 1.0}])
    paths = T.write_all(out)
    assert [os.path.basename(p) for p in paths] == ["trace.json", "timeline.svg", "curves.svg"]
    assert json.load(open(paths[0]))["traceEvents"][0]["ph"] == "M"
    for p in paths[1:]:
        svg_root(p)
    one = write_run(tmp_path / "one", make_spans(1), steps=1)
    assert len(span_rects(svg_root(T.write_all(one)[1]))) == len(make_spans(1)) - 2   # step 1, no warm-up


# --- command line -------------------------------------------------------------------------------

def test_command_line(tmp_path):
    a = write_run(tmp_path / "a", make_spans())
    b = write_run(tmp_path / "b", make_spans())
    r = subprocess.run([sys.executable, "-m", "plumbing.timeline", a], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {"trace.json", "timeline.svg", "curves.svg"} <= set(os.listdir(a))
    out = str(tmp_path / "both.svg")
    r = subprocess.run([sys.executable, "-m", "plumbing.timeline", a, b, "--out", out, "--labels", "x,y"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(polylines(svg_root(out))) == 2 * len(T.CURVES) and "curves.svg" not in os.listdir(b)
    r = subprocess.run([sys.executable, "plumbing/timeline.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "RUN_DIR" in r.stdout


def test_spans_record_name_times_and_args():
    spans = T.Spans()
    spans.args = {"step": 3, "version": 2}
    with spans("rollout"):
        with spans("idle"):
            pass
    (inner, a0, a1, args), (outer, b0, b1, _) = spans.spans  # the inner one ends first
    assert (inner, outer, args) == ("idle", "rollout", {"step": 3, "version": 2}) and b0 <= a0 <= a1 <= b1
    assert spans.total("idle") == a1 - a0 and spans.total(("idle", "rollout")) == (a1 - a0) + (b1 - b0)
    m = spans.perf(100)
    assert set(m) == {"perf/tokens_per_s", "perf/idle_frac"} and 0 < m["perf/idle_frac"] <= 1


class LateDevice:
    """A stand-in for a CUDA stream that runs `lag` seconds behind the host: a mark is reached lag seconds
    after it was recorded. Counts the waits (times calls)."""

    def __init__(self, lag):
        self.lag, self.waits = lag, 0

    def mark(self):
        return time.perf_counter() + self.lag

    def times(self, marks):
        self.waits += 1
        return list(marks)


def test_spans_on_a_device_end_when_the_device_does_and_wait_once_per_settle():
    device = LateDevice(lag=5.0)
    spans = T.Spans(clock=device)
    with spans("train"):
        with spans("reference"):
            pass
    host = list(spans.spans)  # as the host saw them, before the device's marks are read
    assert device.waits == 0  # closing a span does not wait for the device
    assert spans.total("train") >= 0 and device.waits == 1
    (inner, a0, a1, _), (outer, b0, b1, _) = spans.spans
    assert a1 - host[0][2] > 4.9 and b1 - host[1][2] > 4.9  # moved to the device's times (5 s behind)
    assert b0 <= a0 <= a1 <= b1                                # still nested
    with spans("rollout"):
        pass
    spans.settle(), spans.settle()
    assert device.waits == 2  # one wait for the pending span, none when nothing is pending
