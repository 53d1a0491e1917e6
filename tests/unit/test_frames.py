"""The one framing of raw TCP connections (``collectives.wire.frames``): preludes
that every receiver parses the same way, and the bytes earlier releases sent."""

from __future__ import annotations

import os

import pytest

from collectives.wire import frames


@pytest.mark.parametrize(
    ("kind", "version", "first_bytes"),
    [
        (frames.BULK, 1, b"CBK1"),
        (frames.BULK, 2, b"CBK2"),
        (frames.LANE, 1, b"CBL1"),
        (frames.CONTROL, 1, b"CBC1"),
    ],
)
def test_a_prelude_reads_back_and_keeps_the_bytes_clients_already_send(
    kind: bytes, version: int, first_bytes: bytes
) -> None:
    token = os.urandom(frames.TOKEN_BYTES)
    opening = frames.prelude(kind, token, version)
    assert opening == first_bytes + token and len(opening) == frames.PRELUDE_BYTES
    assert frames.parse_prelude(opening) == (kind, version, token)
    assert frames.parse_prelude(memoryview(bytearray(opening))) == (kind, version, token)


@pytest.mark.parametrize(
    "opening",
    [
        b"CBK3" + bytes(16),  # a version this release does not speak
        b"CBL2" + bytes(16),
        b"CBX1" + bytes(16),  # no such kind
        b"CBKx" + bytes(16),
        b"XXK1" + bytes(16),  # not ours at all
        b"CBK1" + bytes(15),  # short
        b"GET / HTTP/1.1\r\n\r\n\0\0",
        b"",
    ],
)
def test_a_prelude_this_release_does_not_speak_is_refused(opening: bytes) -> None:
    assert frames.parse_prelude(opening) is None


def test_a_prelude_is_not_built_for_an_unknown_version_or_a_short_token() -> None:
    with pytest.raises(ValueError, match="version"):
        frames.prelude(frames.LANE, bytes(16), version=2)
    with pytest.raises(ValueError, match="16 bytes"):
        frames.prelude(frames.BULK, bytes(8))


def test_lane_method_ids_are_positions_and_none_named_means_the_first_release() -> None:
    assert frames.lane_method_ids(["AllReduce", "", "Forward"]) == {"AllReduce": 1, "Forward": 3}
    assert frames.lane_method_ids([]) == {
        name: i for i, name in enumerate(frames.FIRST_LANE_METHODS, start=1)
    }
