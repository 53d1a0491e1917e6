"""Every tensor the engine, the kernels and the model code make names its device.

A CUDA worker's data group is NCCL, which takes device tensors only; a factory
call without ``device=`` makes a CPU tensor that works on gloo and fails the
first time it meets NCCL (a gradient bucket packed on the CPU ended the
generation on every fine-tuning step). Control-path tensors say
``device="cpu"``; data-path tensors name the operand's or the worker's device.
"""

from __future__ import annotations

import ast
from pathlib import Path

import collectives_server

FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "eye"}
WORKER = Path(collectives_server.__file__).parent / "worker"
CHECKED = [WORKER / "engine", WORKER / "kernels", WORKER / "models"]


def undevice_calls(source: str, where: str) -> list[str]:
    """``where:LINE: torch.NAME`` for each torch factory call in ``source`` without
    ``device=``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "torch"):
            continue
        if node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords):
            found.append(f"{where}:{node.lineno}: torch.{node.func.attr}")
    return found


def test_every_tensor_factory_names_its_device() -> None:
    files = [p for d in CHECKED for p in sorted(d.rglob("*.py"))]
    assert len(files) > 30, files  # the directories moved: point CHECKED at them
    missing = [
        line
        for p in files
        for line in undevice_calls(p.read_text(), str(p.relative_to(WORKER.parent)))
    ]
    assert not missing, "torch factories without device=:\n" + "\n".join(missing)


def test_the_check_finds_a_factory_without_a_device() -> None:
    source = (
        "import torch\n"
        "flat = torch.empty(4, dtype=torch.float32)\n"
        "ok = torch.zeros(2, device='cpu')\n"
        "t = torch.tensor([1], dtype=torch.int64)\n"
    )
    assert undevice_calls(source, "probe.py") == [
        "probe.py:2: torch.empty",
        "probe.py:4: torch.tensor",
    ]
