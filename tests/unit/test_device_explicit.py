"""Every tensor the engine, the kernels and the model code make names its device.

A CUDA worker's data group is NCCL, which takes device tensors only; a factory
call without ``device=`` makes a CPU tensor that works on gloo and fails the
first time it meets NCCL (a gradient bucket packed on the CPU ended the
generation on every fine-tuning step). Control-path tensors say
``device="cpu"``; data-path tensors name the operand's or the worker's device.
And ``.numpy()`` / ``.data_ptr()`` (host memory only) appear only under a test
of the device, or on a tensor just brought to the host (``.cpu()``, ``.to("cpu")``).
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


_HOST_ONLY = {"numpy", "data_ptr"}


def host_calls_unguarded(source: str, where: str) -> list[str]:
    """``where:LINE: .NAME()`` for each ``.numpy()`` / ``.data_ptr()`` call in ``source``
    neither under an ``if`` / boolean test that mentions the device (or the CPU) nor on
    a tensor moved to the host in the same expression."""
    tree = ast.parse(source, filename=where)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _HOST_ONLY
        ):
            continue
        receiver = ast.unparse(node.func.value)
        if ".cpu()" in receiver or "to('cpu')" in receiver or 'to("cpu")' in receiver:
            continue
        guarded, up = False, parents.get(node)
        while up is not None and not guarded:
            test = up.test if isinstance(up, ast.If | ast.IfExp) else up
            if isinstance(up, ast.If | ast.IfExp | ast.BoolOp):
                text = ast.unparse(test)
                guarded = "device" in text or "cpu" in text
            up = parents.get(up)
        if not guarded:
            found.append(f"{where}:{node.lineno}: .{node.func.attr}()")
    return found


def test_host_memory_is_read_only_on_the_host() -> None:
    files = [p for d in CHECKED for p in sorted(d.rglob("*.py"))]
    unguarded = [
        line
        for p in files
        for line in host_calls_unguarded(p.read_text(), str(p.relative_to(WORKER.parent)))
    ]
    assert not unguarded, "host-only calls without a device guard:\n" + "\n".join(unguarded)


def test_the_host_check_finds_an_unguarded_call() -> None:
    source = (
        "def f(t, u):\n"
        "    a = t.numpy()\n"
        "    if t.device.type == 'cpu':\n"
        "        b = t.data_ptr()\n"
        "    c = u.cpu().numpy()\n"
        "    return t.data_ptr() if u.device == t.device else 0\n"
    )
    assert host_calls_unguarded(source, "probe.py") == ["probe.py:2: .numpy()"]


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
