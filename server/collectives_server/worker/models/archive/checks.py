"""The one model-archive layout a worker accepts, checked before torch sees it.

``torch.export.load`` unpickles in several places (legacy pre-2.7 layouts,
weights and constants whose config says ``use_pickle``, ``opaque_obj_*`` and
``custom_obj_*`` constants whatever their config says, sample inputs when the
restricted load fails) and dlopens AOTInductor ``.so`` files. So instead of
refusing what we know to be dangerous, :func:`check_archive` accepts only what
torch 2.13's ``torch.export.save`` writes for a plain model::

    <root>/archive_format                      "pt2"
    <root>/archive_version                     "0"
    <root>/byteorder                           "little" | "big"
    <root>/.data/version, .data/serialization_id   short ASCII
    <root>/models/<m>.json                     the graph (checked by archive_graph)
    <root>/data/weights/<m>_weights_config.json      payload config, no use_pickle
    <root>/data/constants/<m>_constants_config.json  payload config, no use_pickle
    <root>/data/weights/weight_<n>             raw tensor bytes named by a config
    <root>/data/constants/tensor_<n>           raw tensor bytes named by a config
    <root>/data/sample_inputs/<m>.pt           dropped: written back empty

and refuses anything else (legacy ``version``/``serialized_*`` layouts, pickles,
opaque/custom objects, AOTInductor packages, unknown entries, traversal,
duplicates, encryption, compression other than stored/deflate). Entries are
decompressed as a stream with a running count (a header's sizes are never
trusted) into a *rewritten* archive on disk, so torch reads only bytes that
were checked, and memory holds one chunk (plus the bounded JSON entries).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from collectives.errors import InvalidArgument
from collectives.wire.limits import MODEL_LOAD_TIMEOUT_S
from collectives_server.settings import ARCHIVES, byte_size, positive_float, positive_int, setting
from collectives_server.worker.models.archive.graph import check_graph

__all__ = ["ArchiveLimits", "ModelUploadConfig", "check_archive", "GiB", "MiB"]

MiB = 1 << 20
GiB = 1 << 30
_CHUNK = 1 << 20
_MAX_JSON_DEPTH = 256
_MAX_SMALL_ENTRY = 4096  # archive_format, versions, byteorder, serialization id
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_ROOT_RE = re.compile(rf"^{_NAME}$")
_MODEL_RE = re.compile(r"^models/([A-Za-z0-9_]{1,128})\.json$")
_CONFIG_RE = re.compile(r"^data/(weights|constants)/([A-Za-z0-9_]{1,128})_\1_config\.json$")
_PAYLOAD_RE = re.compile(r"^data/(weights/weight|constants/tensor)_(\d{1,9})$")
_SAMPLE_RE = re.compile(r"^data/sample_inputs/([A-Za-z0-9_]{1,128})\.pt$")
_LEGACY_PT_RE = re.compile(r"^data/\w+/\w+\.pt$")  # data/weights/<m>.pt ...
_SMALL = {
    "archive_format": re.compile(r"^pt2$"),
    "archive_version": re.compile(r"^0$"),
    "byteorder": re.compile(r"^(little|big)$"),
    ".data/version": re.compile(r"^\d{1,8}$"),
    ".data/serialization_id": re.compile(r"^[0-9A-Za-z]{0,128}$"),
}
# torch.export's serialized ScalarType -> element size (torch 2.13's schema), so
# this module needs no torch import.
_DTYPE_BYTES = {
    1: 1, 2: 1, 28: 2, 3: 2, 4: 4, 5: 8, 6: 2, 7: 4, 8: 8, 9: 4, 10: 8, 11: 16, 12: 1,
    13: 2, 29: 1, 30: 1, 31: 1, 32: 1, 33: 1, 34: 4, 35: 8,
}  # fmt: skip
_AOTI_SUFFIXES = (".so", ".dylib", ".dll", ".cpp", ".wrapper", ".cubin", ".o")
_HINT = "save the model with torch.export.save (torch 2.13), or load it with a factory"


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on one uploaded archive (decompressed sizes, counted as they stream)."""

    max_bytes: int = 4 * GiB  # the whole archive, compressed or decompressed
    max_entries: int = 65536
    max_json_bytes: int = 256 * MiB  # each JSON entry, decompressed


@dataclass(frozen=True)
class ModelUploadConfig:
    """How a worker takes model archives."""

    allow: bool = setting(
        False,
        flag="--allow-model-upload",
        action="optional",
        group=ARCHIVES,
        shown_default="off unless --token-file is set",
        help="accept torch.export model archives in load_model (factories are unaffected)",
    )
    max_bytes: int = setting(
        4 * GiB,
        flag="--max-model-bytes",
        parse=byte_size,
        metavar="N",
        group=ARCHIVES,
        shown_default="4GiB",
        help="largest model archive, uploaded and decompressed",
    )
    max_entries: int = setting(
        65536,
        flag="--max-model-entries",
        parse=positive_int,
        metavar="N",
        group=ARCHIVES,
        help="most entries in a model archive",
    )
    max_json_bytes: int = setting(
        256 * MiB,
        flag="--max-model-json-bytes",
        parse=byte_size,
        metavar="N",
        group=ARCHIVES,
        shown_default="256MiB",
        help="largest JSON entry (graph, configs) of a model archive",
    )
    upload_dir: str | None = setting(
        None,
        flag="--model-upload-dir",
        metavar="PATH",
        group=ARCHIVES,
        shown_default="a private temp dir",
        help="directory for uploaded archives while they are checked and loaded, made mode 0700",
    )
    load_sandbox: bool = setting(
        True,
        flag="--load-sandbox",
        action="optional",
        group=ARCHIVES,
        shown_default="on",
        help="first load each archive in a short-lived child with resource limits (as "
        "nobody when root)",
    )
    load_timeout_s: float = setting(
        MODEL_LOAD_TIMEOUT_S,
        flag="--model-load-timeout-s",
        parse=positive_float,
        metavar="S",
        group=ARCHIVES,
        help="how long loading a model archive may take",
    )

    @property
    def limits(self) -> ArchiveLimits:
        return ArchiveLimits(self.max_bytes, self.max_entries, self.max_json_bytes)


def _refuse(message: str) -> InvalidArgument:
    return InvalidArgument(f"model archive refused: {message}; {_HINT}")


def _central_directory(fp: IO[bytes]) -> tuple[int, int]:
    """(entries, bytes) of the central directory as the end record declares them
    (zip64 aware), read before zipfile parses (and holds) every entry of it."""
    end = zipfile._EndRecData(fp)  # type: ignore[attr-defined]  # stdlib, stable since 2.x
    if end is None:
        raise _refuse("not a zip file (no end of central directory)")
    return int(end[zipfile._ECD_ENTRIES_TOTAL]), int(end[zipfile._ECD_SIZE])  # type: ignore[attr-defined]


def _check_name(name: str, root: str | None) -> tuple[str, str]:
    """(root, path under the root); refuses traversal and odd names."""
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or name.endswith("/")
        or any(part in ("", ".", "..") for part in name.split("/"))
        or len(name) > 512
    ):
        raise _refuse(f"entry name {name[:80]!r} is not a plain relative path")
    head, _, rest = name.partition("/")
    if not rest and (head == "version" or head.startswith("serialized_")):
        raise _refuse(f"{head!r} belongs to the legacy (pre-2.7) layout, which is pickled")
    if not rest or not _ROOT_RE.match(head):
        raise _refuse(f"entry {name[:80]!r} is not under the archive's one top-level folder")
    if root is not None and head != root:
        raise _refuse(f"entries under two top-level folders ({root!r}, {head!r})")
    return head, rest


def _classify(rel: str) -> str:
    """What an entry is: 'small', 'model', 'config', 'payload', 'sample'; refuses the rest."""
    lower = rel.lower()
    if lower.startswith("data/aotinductor/") or lower.endswith(_AOTI_SUFFIXES):
        raise _refuse(
            f"{rel!r} is part of an AOTInductor package (compiled code that would be "
            "loaded into the worker)"
        )
    legacy = rel == "version" or rel.startswith("serialized_") or _LEGACY_PT_RE.match(rel)
    if legacy and not _SAMPLE_RE.match(rel):
        raise _refuse(f"{rel!r} belongs to the legacy (pre-2.7) layout, which is pickled")
    if re.search(r"(^|/)(opaque_obj_|custom_obj_)", rel):
        raise _refuse(f"{rel!r} is a pickled opaque or script object")
    if lower.endswith((".pkl", ".pickle")):
        raise _refuse(f"{rel!r} is a pickle")
    if rel in _SMALL:
        return "small"
    if _MODEL_RE.match(rel):
        return "model"
    if _CONFIG_RE.match(rel):
        return "config"
    if _PAYLOAD_RE.match(rel):
        return "payload"
    if _SAMPLE_RE.match(rel):
        return "sample"
    raise _refuse(f"unknown entry {rel[:120]!r}")


def _json_depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_JSON_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def _parse_json(rel: str, body: bytes | None) -> Any:
    try:
        value = json.loads(body or b"")
    except (ValueError, RecursionError):
        raise _refuse(f"{rel!r} is not valid JSON (or nests too deeply)") from None
    if not _json_depth_ok(value):
        raise _refuse(f"{rel!r} nests deeper than {_MAX_JSON_DEPTH} levels")
    return value


def _int_field(value: Any) -> int:
    if isinstance(value, dict) and isinstance(value.get("as_int"), int):
        return value["as_int"]
    raise _refuse("a tensor's size, stride or offset is not a plain integer")


def _storage_bytes(meta: dict[str, Any]) -> int:
    """The most bytes a payload for this tensor_meta may hold (its strided extent)."""
    itemsize = _DTYPE_BYTES.get(meta.get("dtype"))  # type: ignore[arg-type]
    sizes, strides = meta.get("sizes"), meta.get("strides")
    if itemsize is None or not isinstance(sizes, list) or not isinstance(strides, list):
        raise _refuse("a tensor_meta has no known dtype, sizes or strides")
    if len(sizes) != len(strides):
        raise _refuse("a tensor_meta has sizes and strides of different lengths")
    dims = [(_int_field(n), _int_field(st)) for n, st in zip(sizes, strides, strict=True)]
    if any(n < 0 or st < 0 for n, st in dims):
        raise _refuse("a tensor_meta has a negative size or stride")
    if any(n == 0 for n, _ in dims):
        return 0
    extent = _int_field(meta.get("storage_offset", {"as_int": 0}))
    extent += 1 + sum((n - 1) * st for n, st in dims)
    return extent * itemsize


def _check_payload_config(rel: str, config: Any) -> dict[str, int]:
    """The payload files a weights/constants config names, each with the most bytes it
    may hold; refuses pickled or object entries."""
    kind = "weight_" if rel.startswith("data/weights/") else "tensor_"
    if not isinstance(config, dict) or not isinstance(config.get("config"), dict):
        raise _refuse(f"{rel!r} is not a payload config")
    if set(config) - {"config"}:
        raise _refuse(f"{rel!r} has unknown fields {sorted(config)[:5]}")
    paths: dict[str, int] = {}
    for fqn, meta in config["config"].items():
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            raise _refuse(f"{rel!r}: entry {str(fqn)[:80]!r} is not a payload entry")
        if meta.get("use_pickle") is not False:
            raise _refuse(f"{rel!r}: {str(fqn)[:80]!r} is stored pickled (use_pickle)")
        path = meta["path_name"]
        if not re.fullmatch(rf"{kind}\d{{1,9}}", path):
            raise _refuse(
                f"{rel!r}: {str(fqn)[:80]!r} is stored as {path[:80]!r}, not a plain tensor "
                "(opaque, script or custom objects are pickled)"
            )
        if not isinstance(meta.get("tensor_meta"), dict):
            raise _refuse(f"{rel!r}: {str(fqn)[:80]!r} has no tensor_meta")
        full = ("data/weights/" if kind == "weight_" else "data/constants/") + path
        paths[full] = max(paths.get(full, 0), _storage_bytes(meta["tensor_meta"]))
    return paths


class _Budget:
    def __init__(self, limits: ArchiveLimits) -> None:
        self.limits = limits
        self.total = 0

    def add(self, rel: str, n: int, entry_total: int, entry_limit: int) -> None:
        self.total += n
        if entry_total > entry_limit:
            raise _refuse(f"{rel!r} decompresses to more than {entry_limit} bytes")
        if self.total > self.limits.max_bytes:
            raise _refuse(
                f"the archive decompresses to more than {self.limits.max_bytes} bytes "
                "(--max-model-bytes)"
            )


def _entry(name: str) -> zipfile.ZipInfo:
    """A checked archive's entry: no time of its own, so that checking the same
    archive anywhere, or a checked one again, writes the same bytes (a drain's
    successor finds the module it built ahead by them: ``models.built_ahead``)."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


def _copy_entry(
    src: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    rel: str,
    out: zipfile.ZipFile | None,
    budget: _Budget,
    limit: int,
    keep: bool,
) -> bytes | None:
    """Streams one entry into ``out`` (under the same name; ``out`` None: nowhere),
    counting as it goes. Returns the body when ``keep`` (small and JSON entries,
    bounded by ``limit``)."""
    kept = bytearray() if keep else None
    seen = 0
    try:
        with contextlib.ExitStack() as stack:
            reader = stack.enter_context(src.open(info))
            writer = None
            if out is not None:
                writer = stack.enter_context(out.open(_entry(info.filename), "w", force_zip64=True))
            while True:
                chunk = reader.read(_CHUNK)
                if not chunk:
                    break
                seen += len(chunk)
                budget.add(rel, len(chunk), seen, limit)
                if writer is not None:
                    writer.write(chunk)
                if kept is not None:
                    kept += chunk
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as exc:
        raise _refuse(f"entry {rel!r} is corrupt ({type(exc).__name__}: {exc})") from None
    return bytes(kept) if kept is not None else None


def check_archive(src_path: Path, dst_path: Path, limits: ArchiveLimits) -> None:
    """Checks the archive at ``src_path`` and writes the checked copy to ``dst_path``.

    Raises:
        InvalidArgument: anything outside the accepted layout or over a bound.
    """
    with open(src_path, "rb") as fp:
        try:
            declared, cd_bytes = _central_directory(fp)
        except (OSError, EOFError, zipfile.BadZipFile):
            raise _refuse("not a zip file") from None
        # An entry's central record is 46 bytes + name (<= 512 here) + extra/comment.
        if declared > limits.max_entries or cd_bytes > limits.max_entries * 1024:
            raise _refuse(
                f"{declared} entries ({cd_bytes} bytes of central directory); at most "
                f"{limits.max_entries} entries (--max-model-entries)"
            )
        try:
            src = zipfile.ZipFile(fp)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError):
            raise _refuse("not a zip file") from None
        with src:
            infos = src.infolist()
            if len(infos) > limits.max_entries:
                raise _refuse(f"more than {limits.max_entries} entries (--max-model-entries)")
            _check_and_copy(src, infos, dst_path, limits)


def _check_and_copy(
    src: zipfile.ZipFile, infos: list[zipfile.ZipInfo], dst_path: Path, limits: ArchiveLimits
) -> None:
    root: str | None = None
    seen: set[str] = set()
    kinds: dict[str, tuple[zipfile.ZipInfo, str]] = {}
    for info in infos:
        root, rel = _check_name(info.filename, root)
        if rel in seen:
            raise _refuse(f"entry {rel!r} appears twice")
        seen.add(rel)
        if info.flag_bits & 0x1:
            raise _refuse(f"entry {rel!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise _refuse(
                f"entry {rel!r} uses compression {info.compress_type}; only stored/deflate"
            )
        kinds[rel] = (info, _classify(rel))
    for required in ("archive_format", "archive_version"):
        if required not in kinds:
            raise _refuse(f"no {required} entry: not a torch.export archive")
    models = {m.group(1) for rel in kinds if (m := _MODEL_RE.match(rel))}
    if not models:
        raise _refuse("no models/<name>.json: not a torch.export archive")
    for name in models:
        for cfg in (
            f"data/weights/{name}_weights_config.json",
            f"data/constants/{name}_constants_config.json",
        ):
            if cfg not in kinds:
                raise _refuse(f"model {name!r} has no {cfg}")

    budget = _Budget(limits)
    named_payloads: dict[str, int] = {}
    payloads: list[tuple[zipfile.ZipInfo, str]] = []
    tmp = dst_path.with_name(dst_path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as out:
            # JSON and small entries first: the configs say which payloads may follow.
            for rel, (info, kind) in kinds.items():
                if kind == "payload":
                    payloads.append((info, rel))
                elif kind == "sample":
                    # torch unpickles sample inputs (falling back to a full unpickle);
                    # an empty entry deserializes to {} without pickle.
                    out.writestr(_entry(info.filename), b"")
                elif kind == "small":
                    body = _copy_entry(src, info, rel, out, budget, _MAX_SMALL_ENTRY, True)
                    if not _SMALL[rel].match((body or b"").decode("ascii", "replace").strip()):
                        raise _refuse(f"{rel!r} holds an unexpected value")
                elif kind == "config":
                    body = _copy_entry(src, info, rel, out, budget, limits.max_json_bytes, True)
                    for path, n in _check_payload_config(rel, _parse_json(rel, body)).items():
                        named_payloads[path] = max(named_payloads.get(path, 0), n)
                else:
                    body = _copy_entry(src, info, rel, None, budget, limits.max_json_bytes, True)
                    program = _parse_json(rel, body)
                    check_graph(rel, program)
                    # Guards are Python source torch would exec (only with sample
                    # inputs, which are dropped); written back without them.
                    program["guards_code"] = []
                    del body
                    out.writestr(_entry(info.filename), json.dumps(program).encode())
            for info, rel in payloads:
                if rel not in named_payloads:
                    raise _refuse(f"{rel!r} is named by no weights/constants config")
                limit = min(named_payloads[rel], limits.max_bytes)
                _copy_entry(src, info, rel, out, budget, limit, False)
        os.replace(tmp, dst_path)
    finally:
        if tmp.exists():
            tmp.unlink()
