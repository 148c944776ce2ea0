"""The import-linter contract of ``pyproject.toml``: every import points down the pack's layers.

The top-level folders (``recipes/``, ``ecg_tokenizer/`` ...) are installed under ``hlmtune.``
(``[tool.setuptools.package-dir]``), so the source tree is not the package tree that grimp
walks. Each test lays the package out as installed, in a temporary folder, and runs
``lint-imports`` there; the second one adds an upward import to that copy and expects the
contract to break, naming the import.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _installed_layout(dest: Path) -> Path:
    """Copy the sources to ``dest`` in the layout ``pip install`` gives them; returns ``dest``."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):  # hlmtune first
        shutil.copytree(ROOT / folder, dest / Path(*package.split(".")), ignore=ignore, dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([LINT_IMPORTS, "--no-cache", "pyproject.toml"], cwd=tree, env=env,
                          capture_output=True, text=True)


def test_every_import_points_down_the_layers(tmp_path):
    tree = _installed_layout(tmp_path)
    proc = _lint(tree)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout
    # every installed module was analysed, the top-level folders' too, not only hlmtune/'s
    modules = len(list((tree / "hlmtune").rglob("*.py")))
    assert f"Analyzed {modules} files" in proc.stdout, proc.stdout[-800:]


def test_an_upward_import_breaks_the_contract(tmp_path):
    tree = _installed_layout(tmp_path)
    vocab = tree / "hlmtune" / "ecg_tokenizer" / "vocab.py"
    vocab.write_text(vocab.read_text() + "\nfrom hlmtune.hlm import evaluate  # the data layer reaching up\n")
    proc = _lint(tree)
    assert proc.returncode != 0
    assert "hlmtune.ecg_tokenizer is not allowed to import hlmtune.hlm" in proc.stdout
    assert "hlmtune.ecg_tokenizer.vocab -> hlmtune.hlm.evaluate" in proc.stdout


def test_a_subpackage_importing_a_private_module_breaks_the_contract(tmp_path):
    tree = _installed_layout(tmp_path)
    status = tree / "hlmtune" / "sweep" / "status.py"
    status.write_text(status.read_text() + "\nfrom hlmtune import _cli_core  # a private module\n")
    proc = _lint(tree)
    assert proc.returncode != 0
    assert "hlmtune.sweep is not allowed to import hlmtune._cli_core" in proc.stdout


def _private_imports(path: Path, package: str) -> list:
    """``(line, module)`` for each import in ``path`` of an underscore module outside ``package``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "hlmtune":
                continue
            private = next((i for i, p in enumerate(parts) if p.startswith("_") and p != "__init__"), None)
            if private is not None and ".".join(parts[:private]) != package:
                found.append((node.lineno, name))
    return found


def test_no_module_imports_another_package_s_underscore_module(tmp_path):
    # Wider than the contract: every underscore module, present or future (tests excepted:
    # they test private modules by name).
    tree = _installed_layout(tmp_path)
    bad = []
    for path in sorted((tree / "hlmtune").rglob("*.py")):
        rel = path.relative_to(tree).with_suffix("")
        package = ".".join(rel.parts[:-1])
        bad += [f"{rel}.py:{line} imports {name}" for line, name in _private_imports(path, package)]
    assert not bad, bad


def test_no_function_over_80_lines_without_a_reason(tmp_path):
    # Issue 41's aim: stage-sized functions; a longer one says why in its docstring ("Over 80 lines: ...").
    tree = _installed_layout(tmp_path)
    long = []
    for path in sorted((tree / "hlmtune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80 and "Over 80 lines" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(tree)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
