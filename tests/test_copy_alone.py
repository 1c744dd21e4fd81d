"""Copy one file and it works: each mechanism file, copied alone into an empty folder, runs the usage
example its docstring gives (real code, on 1 or 2 gloo processes), so the example cannot drift from
the code. Also: the files import nothing of this project. A file meant to be copied with another
(TOGETHER: none today) would run its example in a folder holding only the two."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MECHANISMS = ["fusion.py", "stalesync.py", "distqueue.py", "moe_switch.py", "curriculum.py", "options/gradsync.py",
              "options/reward_model.py"]
STANDALONE = MECHANISMS + ["grpo.py", "task.py", "plumbing/timeline.py", "plumbing/shm_transport.py"]
TOGETHER = {}  # a file -> the files copied with it (it imports them)
FOLDERS = ("", "plumbing", "options")  # the core at the top level, the plumbing and the options beside it
PROJECT = {os.path.splitext(f)[0] for d in FOLDERS for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")}
PROJECT |= {d for d in FOLDERS if d}  # `from options import ...`


def docstring_example(path):
    """The indented block after the first blank line that follows the docstring's mention of this test."""
    doc = ast.get_docstring(ast.parse(open(path).read()), clean=False)
    lines = doc.split("\n")
    start = next(i for i, line in enumerate(lines) if "tests/test_copy_alone.py" in line)
    start = next(i for i in range(start, len(lines)) if not lines[i].strip())
    block = []
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip() + "\n"


@pytest.mark.parametrize("name", MECHANISMS + list(TOGETHER))
def test_a_copied_file_runs_its_docstring_example(tmp_path, name):
    files = [name] + TOGETHER.get(name, [])
    for f in files:  # each into the empty folder itself, whatever folder it lives in here
        shutil.copy(os.path.join(ROOT, f), tmp_path / os.path.basename(f))
    (tmp_path / "example.py").write_text(docstring_example(os.path.join(ROOT, name)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # 2 processes on 2 cores
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, f"{name}'s example failed in a folder holding only {files}:\n{r.stdout}\n{r.stderr}"
    assert set(os.listdir(tmp_path)) - {"__pycache__"} == {"example.py", *map(os.path.basename, files)}  # nothing else
    assert r.stdout.strip(), "the example printed nothing"


@pytest.mark.parametrize("name", STANDALONE + list(TOGETHER))
def test_a_standalone_file_imports_nothing_of_the_project(name):
    tree = ast.parse(open(os.path.join(ROOT, name)).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported -= {os.path.splitext(os.path.basename(f))[0] for f in TOGETHER.get(name, [])}  # copied with it
    own = os.path.splitext(os.path.basename(name))[0]
    assert not imported & (PROJECT - {own}), f"{name} imports {imported & PROJECT}"
    assert imported <= {"torch", "numpy"} | sys.stdlib_module_names, imported - sys.stdlib_module_names
    first = open(os.path.join(ROOT, name)).readline()
    assert "SPDX-License-Identifier: MIT" in first, f"{name}'s first line names no licence"
