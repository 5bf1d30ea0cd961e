"""The student stubs are generated from the reference (staff/make_stubs.py): fail when they drift apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.staff
def test_stubs_match_the_reference():
    proc = subprocess.run([sys.executable, "staff/make_stubs.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.staff
def test_every_stub_function_raises_naming_its_task():
    # Run in a subprocess: the pytest process never imports task modules.
    code = r"""
import ast, pathlib, sys
sys.path.insert(0, '.')
from adapters import TASK_MODULES
bad = []
for task, name in TASK_MODULES.items():
    tree = ast.parse(pathlib.Path(f'fsdp_assignment/{name}.py').read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith('_') or getattr(node, 'name', '') == '__init__':
            raise_ = node.body[-1]
            text = ast.unparse(raise_)
            if not (isinstance(raise_, ast.Raise) and f'Task {task}: implement' in text):
                bad.append(f'{name}.{node.name}')
print('\n'.join(bad))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"stub functions that do not raise NotImplementedError('Task N: ...'): {proc.stdout}"
