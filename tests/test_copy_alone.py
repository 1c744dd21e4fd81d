"""Copy one file and it works: each mechanism file, copied with its companion alone into an empty folder, runs
the usage example that its docstring, or its companion's, gives (real code, on 1 or 2 gloo processes), so the
example cannot drift from the code. Also: the files import nothing of this project. A mechanism file teaches
its concept; what a learner can take on trust (the checks of the caller's input, the brakes, recovery) may
live in its companion, `plumbing/<file>_*.py`, which it imports by name and which imports nothing of the
project itself: the two are copied together, the folder kept. A standalone file may have one too:
options/planner.py's holds its formulas (tests/test_planner.py runs the two alone)."""
import ast
import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MECHANISMS = ["fusion.py", "stalesync.py", "distqueue.py", "moe_switch.py", "curriculum.py", "options/gradsync.py",
              "options/reward_model.py"]
STANDALONE = MECHANISMS + ["grpo.py", "task.py", "plumbing/timeline.py", "plumbing/shm_transport.py",
                           "options/planner.py"]
FOLDERS = ("", "plumbing", "options")  # the core at the top level, the plumbing and the options beside it
PROJECT = {os.path.splitext(f)[0] for d in FOLDERS for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
PROJECT |= {d for d in FOLDERS if d}  # `from options import ...`


def stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def companions(name):
    """The project modules a standalone file imports: each must be its own `plumbing/<stem>_*.py`."""
    tree = ast.parse(open(os.path.join(ROOT, name)).read())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return sorted(m.replace(".", "/") + ".py" for m in modules if m.startswith("plumbing."))


COMPANIONS = sorted({c for name in STANDALONE for c in companions(name)})


def docstring_example(path):
    """The indented block after the first blank line that follows the docstring's mention of this test
    ("" if there is none)."""
    doc = ast.get_docstring(ast.parse(open(path).read()), clean=False)
    lines = doc.split("\n")
    start = next((i for i, line in enumerate(lines) if "tests/test_copy_alone.py" in line), len(lines))
    start = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    block = []
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


def usage_example(name):
    """A standalone file's usage example: in its docstring, or in its companion's (which it says)."""
    for path in [name, *companions(name)]:
        example = docstring_example(os.path.join(ROOT, path))
        if example.strip():
            return example
    raise AssertionError(f"{name}: no usage example in its docstring or its companion's")


def test_a_companion_is_its_mechanism_files_own():
    for name in STANDALONE:
        for c in companions(name):
            assert c.startswith("plumbing/" + stem(name) + "_"), f"{name} imports {c}, not a companion of its own"
            assert os.path.exists(os.path.join(ROOT, c)), c


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_copied_file_runs_its_docstring_example(tmp_path, name):
    files = [name] + companions(name)
    for f in files:  # the mechanism file into the empty folder itself, its companions into plumbing/ there
        dest = tmp_path / (os.path.basename(f) if f == name else f)
        dest.parent.mkdir(exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), dest)
    (tmp_path / "example.py").write_text(usage_example(name))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # 2 processes on 2 cores
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, f"{name}'s example failed in a folder holding only {files}:\n{r.stdout}\n{r.stderr}"
    copied = {os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "**"), recursive=True)
              if os.path.isfile(p) and "__pycache__" not in p}
    assert copied == {"example.py", os.path.basename(name), *companions(name)}  # nothing else
    assert r.stdout.strip(), "the example printed nothing"


@pytest.mark.parametrize("name", STANDALONE + COMPANIONS)
def test_a_standalone_file_imports_nothing_of_the_project(name):
    tree = ast.parse(open(os.path.join(ROOT, name)).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    if companions(name):
        imported -= {"plumbing"}  # its companions, checked by test_a_companion_is_its_mechanism_files_own
    own = stem(name)
    assert not imported & (PROJECT - {own}), f"{name} imports {imported & PROJECT}"
    assert imported <= {"torch", "numpy"} | sys.stdlib_module_names, imported - sys.stdlib_module_names
    first = open(os.path.join(ROOT, name)).readline()
    assert "SPDX-License-Identifier: MIT" in first, f"{name}'s first line names no licence"
