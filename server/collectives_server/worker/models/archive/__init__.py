"""Model archives: the one layout a worker accepts, checked before torch reads it.

Modules:

* ``checks``: the archive's layout and entries, checked without torch, and the
  --allow-model-upload flags as a dataclass (``ModelUploadConfig``)
* ``graph``: checks on the serialized export graph
* ``canary``: a checked archive is first loaded in a short-lived child
* ``upload``: LoadModel's upload, streamed to a private file and counted
"""
