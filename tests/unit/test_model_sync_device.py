"""A worker joining a generation of CUDA workers receives an exported model.

The joiner gets the model's archive and weights from a peer (``model_sync``).
The archive is host bytes; sent as a CPU tensor on the data group, NCCL refused
it and the generation failed to form, again and again. Here the data group is
NCCL-like on ``meta`` (tests/fake_nccl.py: it refuses any tensor off its device),
every rank's models live on ``meta``, and rank 1 must end up hosting rank 0's model.
"""

from __future__ import annotations

import torch
from fake_nccl import FakeNcclWorld
from fake_pg import run_ranks
from handler_world import Cluster
from torch import nn

from collectives_server.worker.engine import model_sync
from collectives_server.worker.models.archive.checks import ModelUploadConfig
from collectives_server.worker.models.archive.upload import ModelUploads
from collectives_server.worker.models.registry import ModelDefinition, ModelRegistry

META = torch.device("meta")


def test_a_joiner_receives_an_exported_model_over_an_nccl_data_group(tmp_path) -> None:
    cl = Cluster(2, data=FakeNcclWorld(2, META))  # type: ignore[arg-type]
    uploads = [
        ModelUploads(ModelUploadConfig(allow=True, load_sandbox=False), device=META)
        for _ in range(2)
    ]
    try:
        for ctx in cl.ctxs:
            ctx.device = META
            ctx.models = ModelRegistry([META])
        program = torch.export.export(nn.Linear(4, 3), (torch.randn(2, 4),))
        upload = tmp_path / "linear.upload"
        with upload.open("wb") as f:
            torch.export.save(program, f)
        kept = uploads[0].kept_path()
        module = uploads[0].load(upload, keep=kept)
        cl.ctxs[0].models.add("linear", module, "export", ModelDefinition(archive=kept))

        received = run_ranks(
            cl.world, lambda r, _pg: model_sync.sync_models(cl.ctxs[r], uploads[r]), 60
        )
        assert received == [0, 1], received

        hosted = cl.ctxs[1].models.get("linear", wait_s=60)  # built in the background
        assert {p.device for p in hosted.module.parameters()} == {META}
    finally:
        for u in uploads:
            u.close()
