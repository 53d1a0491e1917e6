"""An exported model loaded on a worker runs where the worker's device is.

``torch.export`` lifts tensor constants out of the module and bakes the
exporting machine's ``device=cpu`` into factory ops (``arange``, ``zeros``,
``full``). ``Module.to(device)`` moves parameters and buffers only, so a CUDA
worker's first forward mixed devices. The worker loads archives through
``ModelUploads.load``, which moves the program with torch's export pass; ``meta``
stands in for ``cuda`` (no GPU needed: nothing is computed, only placed).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from collectives_server.worker.models.archive.checks import ModelUploadConfig
from collectives_server.worker.models.archive.upload import ModelUploads

META = torch.device("meta")


class WithConstantsAndFactories(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.offset = torch.tensor([1.0, 2.0, 3.0])  # a plain attribute: a lifted constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(x.shape[-1], dtype=x.dtype)  # a factory op: device baked in
        return self.lin(x + steps) * self.scale + self.offset + torch.zeros(3)


def _archive(tmp_path: Path) -> Path:
    program = torch.export.export(WithConstantsAndFactories(), (torch.randn(2, 4),))
    path = tmp_path / "model.upload"  # as received: ModelUploads.load writes the checked .pt2
    with path.open("wb") as f:
        torch.export.save(program, f)
    return path


def _devices_left(module: nn.Module) -> set[str]:
    """Every device a tensor of ``module`` lives on or a factory op of its graph names."""
    found = {str(t.device) for t in module.state_dict().values()}
    found |= {str(v.device) for _, v in vars(module).items() if isinstance(v, torch.Tensor)}
    for sub in module.modules():
        found |= {str(v.device) for v in vars(sub).values() if isinstance(v, torch.Tensor)}
        graph = getattr(sub, "graph", None)
        for node in graph.nodes if graph is not None else ():
            device = node.kwargs.get("device")
            if device is not None:
                found.add(str(device))
    return found


def test_a_loaded_archive_holds_and_makes_everything_on_the_workers_device(tmp_path) -> None:
    uploads = ModelUploads(ModelUploadConfig(allow=True, load_sandbox=False), device=META)
    try:
        module = uploads.load(_archive(tmp_path))
    finally:
        uploads.close()
    assert _devices_left(module) == {"meta"}
    out = module(torch.empty(2, 4, device=META))  # runs: no tensor of another device met
    assert out.device == META and out.shape == (2, 3)


def test_module_to_alone_leaves_constants_and_factories_on_the_cpu(tmp_path) -> None:
    """Why the pass: what the worker did before (the loaded module, then .to())."""
    module = torch.export.load(str(_archive(tmp_path))).module().to(META)
    assert "cpu" in _devices_left(module)


def test_a_cpu_worker_loads_the_program_as_it_was(tmp_path) -> None:
    uploads = ModelUploads(ModelUploadConfig(allow=True, load_sandbox=False))
    try:
        module = uploads.load(_archive(tmp_path))
    finally:
        uploads.close()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    reference = WithConstantsAndFactories()
    reference.load_state_dict(module.state_dict(), strict=False)
    torch.testing.assert_close(module(x), reference(x))
