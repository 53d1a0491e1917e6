"""The model-archive flags of ``worker`` and ``local`` (see docs/security.md).

``worker``: uploads are off unless ``--allow-model-upload`` or a ``--token-file``
is given; the load sandbox is on. ``local`` (loopback only): uploads on, sandbox
off; both forwarded to its workers with the bounds below.
"""

from __future__ import annotations

import argparse

from collectives.wire.limits import MODEL_LOAD_TIMEOUT_S
from collectives_server.cli.common import byte_size, positive_float, positive_int
from collectives_server.worker.models.archive.checks import ModelUploadConfig

__all__ = ["add_archive_flags", "archive_from_args", "archive_worker_args"]


def add_archive_flags(parser: argparse.ArgumentParser, *, local: bool = False) -> None:
    g = parser.add_argument_group("model archives (see docs/security.md)")
    g.add_argument(
        "--allow-model-upload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accept torch.export model archives in load_model (factories are unaffected); "
        + (
            "default: on (the local cluster binds loopback only)"
            if local
            else "default: off unless --token-file is set"
        ),
    )
    g.add_argument(
        "--max-model-bytes",
        type=byte_size,
        default=4 << 30,
        metavar="N",
        help="largest model archive, uploaded and decompressed (default: 4GiB)",
    )
    g.add_argument(
        "--max-model-entries",
        type=positive_int,
        default=65536,
        metavar="N",
        help="most entries in a model archive (default: 65536)",
    )
    g.add_argument(
        "--max-model-json-bytes",
        type=byte_size,
        default=256 << 20,
        metavar="N",
        help="largest JSON entry (graph, configs) of a model archive (default: 256MiB)",
    )
    g.add_argument(
        "--model-upload-dir",
        metavar="PATH",
        default=None,
        help="directory for uploaded archives while they are checked and loaded, made "
        "mode 0700 (default: a private temp dir)",
    )
    g.add_argument(
        "--load-sandbox",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first load each archive in a short-lived child with resource limits (as "
        "nobody when root); default: " + ("off" if local else "on"),
    )
    g.add_argument(
        "--model-load-timeout-s",
        type=positive_float,
        default=MODEL_LOAD_TIMEOUT_S,
        metavar="S",
        help=f"how long loading a model archive may take (default: {MODEL_LOAD_TIMEOUT_S:g})",
    )


def archive_from_args(args: argparse.Namespace) -> ModelUploadConfig:
    """A ``worker``'s settings (defaults: uploads only with a token, sandbox on)."""
    allow = args.allow_model_upload
    if allow is None:
        allow = bool(getattr(args, "token_file", None))
    return ModelUploadConfig(
        allow=allow,
        max_bytes=args.max_model_bytes,
        max_entries=args.max_model_entries,
        max_json_bytes=args.max_model_json_bytes,
        upload_dir=args.model_upload_dir,
        load_sandbox=True if args.load_sandbox is None else args.load_sandbox,
        load_timeout_s=args.model_load_timeout_s,
    )


def archive_worker_args(args: argparse.Namespace) -> list[str]:
    """What ``local`` passes its workers (defaults: uploads on, sandbox off)."""
    allow = True if args.allow_model_upload is None else args.allow_model_upload
    sandbox = False if args.load_sandbox is None else args.load_sandbox
    out = [
        "--allow-model-upload" if allow else "--no-allow-model-upload",
        "--load-sandbox" if sandbox else "--no-load-sandbox",
        f"--max-model-bytes={args.max_model_bytes}",
        f"--max-model-entries={args.max_model_entries}",
        f"--max-model-json-bytes={args.max_model_json_bytes}",
        f"--model-load-timeout-s={args.model_load_timeout_s}",
    ]
    if args.model_upload_dir:
        out.append(f"--model-upload-dir={args.model_upload_dir}")
    return out
