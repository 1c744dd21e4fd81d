"""docs/walkthrough.md's traces are the scripts' own output: docs/trace_cut.py's stands in the page
verbatim (the cut is deterministic), docs/trace_queue.py's line for line (its two ranks' store
operations interleave with the timing, so only each line's presence is checked)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "walkthrough.md")


def _run(script):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "docs", script)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _block(after):
    """The page's code block that follows the line naming `after`."""
    page = open(PAGE).read()
    start = page.index("```\n", page.index(after)) + 4
    return page[start:page.index("```", start)]


def test_the_shared_cut_trace_is_the_scripts_output():
    assert _run("trace_cut.py") == _block("python docs/trace_cut.py")


def test_the_queue_trace_is_the_scripts_output():
    def by_rank(text):  # each rank's lines, in any order
        parts = re.split(r"^(rank \d+:)$", text, flags=re.M)[1:]
        return {head: sorted(body.strip().splitlines()) for head, body in zip(parts[::2], parts[1::2])}
    got, page = by_rank(_run("trace_queue.py")), by_rank(_block("python docs/trace_queue.py"))
    assert got == page and len(got) == 2
