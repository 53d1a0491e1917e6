"""Hostile model archives, built in memory: pickled layouts and constants, AOTInductor
packages, zip bombs and friends.

Each builder starts from a real ``torch.export.save`` archive of a small model
with random weights and changes what the attack needs. Payload pickles create
``marker`` (a file path) when unpickled, so a test can show that nothing ran.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "SmallModel",
    "legit_archive",
    "legacy_layout",
    "opaque_constant",
    "aoti_package",
    "zip_bomb",
    "rewrite",
    "guards_code",
    "encrypted_flag",
    "marker_pickle",
    "HOSTILE",
]

MiB = 1 << 20


class SmallModel(nn.Module):
    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(4, 6, generator=gen))
            self.fc.bias.copy_(torch.randn(4, generator=gen))
        self.register_buffer("shift", torch.randn(4, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + self.shift


def legit_archive(model: nn.Module, example: torch.Tensor) -> bytes:
    """What a user writes with ``torch.export.save`` (sample inputs included)."""
    program = torch.export.export(model, (example,))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def marker_pickle(marker: str) -> bytes:
    """A pickle that creates ``marker`` when loaded (what an attacker would run)."""
    return pickle.dumps(_CreatesFile(marker), protocol=2)


def _root(names: list[str]) -> str:
    return names[0].split("/", 1)[0]


def rewrite(
    base: bytes,
    replace: dict[str, bytes | None] | None = None,
    add: dict[str, bytes] | None = None,
    compression: int = zipfile.ZIP_STORED,
    raw_names: bool = False,
) -> bytes:
    """``base`` with entries (paths under its root folder) replaced, removed (None) or
    added; ``raw_names``: added names are used as they are (no root folder)."""
    replace, add = replace or {}, add or {}
    src = zipfile.ZipFile(io.BytesIO(base))
    root = _root(src.namelist())
    out_buf = io.BytesIO()
    with zipfile.ZipFile(out_buf, "w", compression) as out:
        for info in src.infolist():
            rel = info.filename[len(root) + 1 :]
            if rel in replace:
                if replace[rel] is not None:
                    out.writestr(info.filename, replace[rel])
            else:
                out.writestr(info.filename, src.read(info))
        for name, body in add.items():
            out.writestr(name if raw_names else f"{root}/{name}", body)
    return out_buf.getvalue()


def legacy_layout(base: bytes, marker: str) -> bytes:
    """The pre-2.7 layout (top-level ``version``, ``serialized_*``): torch.export.load
    falls back to it when there is no ``models/*.json``, and unpickles the state dict
    with ``weights_only=False`` once the restricted load fails."""
    src = zipfile.ZipFile(io.BytesIO(base))
    root = _root(src.namelist())
    program = src.read(f"{root}/models/model.json")
    from torch._export.serde.schema import SCHEMA_VERSION

    out_buf = io.BytesIO()
    with zipfile.ZipFile(out_buf, "w") as out:
        out.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        out.writestr("serialized_exported_program.json", program)
        out.writestr("serialized_state_dict.pt", marker_pickle(marker))
        out.writestr("serialized_constants.pt", marker_pickle(marker))
        out.writestr("serialized_example_inputs.pt", marker_pickle(marker))
    return out_buf.getvalue()


def opaque_constant(base: bytes, marker: str) -> bytes:
    """A constant stored as ``opaque_obj_0`` with ``use_pickle: false``; torch
    ``pickle.loads`` it anyway because of its file name."""
    config = {
        "config": {
            "evil": {
                "path_name": "opaque_obj_0",
                "is_param": False,
                "use_pickle": False,
                "tensor_meta": {
                    "dtype": 1,
                    "sizes": [],
                    "requires_grad": False,
                    "device": {"type": "cpu", "index": None},
                    "strides": [],
                    "storage_offset": {"as_int": 0},
                    "layout": 7,
                },
            }
        }
    }
    return rewrite(
        base,
        replace={"data/constants/model_constants_config.json": json.dumps(config).encode()},
        add={"data/constants/opaque_obj_0": marker_pickle(marker)},
    )


def aoti_package(base: bytes, gen: torch.Generator) -> bytes:
    """An AOTInductor-style package: ``data/aotinductor/<m>/`` with a shared object
    (random bytes: it must never reach dlopen), its wrapper source and config."""
    blob = torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8).numpy().tobytes()
    return rewrite(
        base,
        add={
            "data/aotinductor/model/model.so": b"\x7fELF" + blob,
            "data/aotinductor/model/model.wrapper.cpp": b"int main() { return 0; }\n",
            "data/aotinductor/model/model_metadata.json": b'{"AOTI_DEVICE_KEY": "cpu"}',
        },
    )


def zip_bomb(base: bytes, entry_mib: int = 768) -> bytes:
    """A zip bomb: weight_0 replaced by ``entry_mib`` MiB of zeros, deflated (< 1 MiB sent)."""
    src = zipfile.ZipFile(io.BytesIO(base))
    root = _root(src.namelist())
    out_buf = io.BytesIO()
    zeros = bytes(MiB)
    with zipfile.ZipFile(out_buf, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename == f"{root}/data/weights/weight_0":
                with out.open(info.filename, "w", force_zip64=True) as w:
                    for _ in range(entry_mib):
                        w.write(zeros)
            else:
                out.writestr(info.filename, src.read(info))
    return out_buf.getvalue()


def encrypted_flag(base: bytes, rel: str = "archive_format") -> bytes:
    """``base`` with the "encrypted" bit set on one entry (local and central headers)."""
    data = bytearray(rewrite(base))
    zf = zipfile.ZipFile(io.BytesIO(bytes(data)))
    info = next(i for i in zf.infolist() if i.filename.endswith("/" + rel))
    data[info.header_offset + 6] |= 0x1  # local file header: general purpose flags
    name = info.filename.encode()
    central = data.rfind(b"PK\x01\x02", 0, data.rfind(name))  # its central header
    data[central + 8] |= 0x1
    return bytes(data)


def _graph_with(base: bytes, change: Callable[[dict], None]) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(base))
    root = _root(src.namelist())
    program = json.loads(src.read(f"{root}/models/model.json"))
    change(program)
    return rewrite(base, replace={"models/model.json": json.dumps(program).encode()})


def _eval_expr(marker: str) -> Callable[[dict], None]:
    def change(program: dict) -> None:
        program["range_constraints"] = {}
        nodes = program["graph_module"]["graph"]["nodes"]
        nodes[0]["outputs"] = [
            {"as_sym_int": {"as_expr": {"expr_str": f"__import__('os').mknod('{marker}')"}}}
        ]

    return change


def _custom_op(program: dict) -> None:
    program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.ops.evil_ns.run.default"


def guards_code(base: bytes, marker: str) -> bytes:
    """Python source in ``guards_code``: torch execs it into the guard function of
    ``.module()`` when the archive has sample inputs, and runs it on every forward."""

    def change(program: dict) -> None:
        program["guards_code"] = [f"open({marker!r}, 'w') is not None"]

    return _graph_with(base, change)


def _use_pickle_weight(base: bytes, marker: str) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(base))
    root = _root(src.namelist())
    config = json.loads(src.read(f"{root}/data/weights/model_weights_config.json"))
    first = next(iter(config["config"].values()))
    first["use_pickle"] = True
    return rewrite(
        base,
        replace={
            "data/weights/model_weights_config.json": json.dumps(config).encode(),
            f"data/weights/{first['path_name']}": marker_pickle(marker),
        },
    )


# name -> builder(base archive, marker path, generator) for the parametrized tests.
HOSTILE: dict[str, Callable[[bytes, str, torch.Generator], bytes]] = {
    "legacy_layout": lambda b, m, g: legacy_layout(b, m),
    "opaque_obj_constant": lambda b, m, g: opaque_constant(b, m),
    "aotinductor_package": lambda b, m, g: aoti_package(b, g),
    "use_pickle_weight": lambda b, m, g: _use_pickle_weight(b, m),
    "legacy_weights_pt": lambda b, m, g: rewrite(
        b, add={"data/weights/model.pt": marker_pickle(m)}
    ),
    "pickle_entry": lambda b, m, g: rewrite(b, add={"data/weights/extra.pkl": marker_pickle(m)}),
    "sympy_eval_expr": lambda b, m, g: _graph_with(b, _eval_expr(m)),
    "custom_namespace_op": lambda b, m, g: _graph_with(b, _custom_op),
    "traversal_name": lambda b, m, g: rewrite(
        b, add={"archive/../../../tmp/evil": b"x"}, raw_names=True
    ),
    "absolute_name": lambda b, m, g: rewrite(b, add={"/tmp/evil": b"x"}, raw_names=True),
    "unknown_entry": lambda b, m, g: rewrite(b, add={"extra/notes.txt": b"hello"}),
    "two_roots": lambda b, m, g: rewrite(b, add={"other/archive_format": b"pt2"}, raw_names=True),
    "bzip2_entries": lambda b, m, g: rewrite(b, compression=zipfile.ZIP_BZIP2),
    "deep_json": lambda b, m, g: rewrite(
        b, replace={"models/model.json": b"[" * 5000 + b"]" * 5000}
    ),
    "not_a_zip": lambda b, m, g: b"PK\x03\x04" + b[:100] + bytes(64),
}
