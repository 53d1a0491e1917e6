"""``collectives-server``: one entry point, one module per subcommand.

Modules:

* ``main``: the entry point: parses the subcommand and runs it
* ``coordinator``: ``collectives-server coordinator``
* ``worker``: ``collectives-server worker``
* ``local``: ``collectives-server local``
* ``common``: the security, logging and metrics flags and the process set-up shared by the
  subcommands
* ``control``: the worker token flag of the coordinator, the workers and ``local``
* ``reference``: every subcommand's flags as markdown (``docs/flags.md``, ``make docs``)

A worker's flags are declared on its config (``collectives_server.worker.config``,
through ``collectives_server.settings``), not here.
"""
