"""``collectives-server``: one entry point, one module per subcommand.

Modules:

* ``main``: the entry point: parses the subcommand and runs it
* ``coordinator``: ``collectives-server coordinator``
* ``worker``: ``collectives-server worker``
* ``local``: ``collectives-server local``
* ``common``: argument types and process set-up shared by the subcommands
* ``archive``: the model-archive flags
* ``control``: the coordinator's control-plane hardening flags
* ``data_plane``: the flags bounding calls a client can hold on a worker
* ``groups``: the flags bounding what a client can make a worker hold (--max-groups)
"""
