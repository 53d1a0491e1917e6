"""The tensor wire codec, at its historical address: see :mod:`collectives.wire.codec`.

The codec moved into :mod:`collectives.wire`, the package the SDK and the
servers share; this module re-exports its public names so that code written
against ``collectives.codec`` keeps working. New code imports the wire package.
"""

from collectives.wire.codec import *  # noqa: F403
from collectives.wire.codec import __all__ as __all__
