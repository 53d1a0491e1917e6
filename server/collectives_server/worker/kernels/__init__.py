"""The data collectives on one process group (above ``data``).

Modules:

* ``collective_ops``: broadcast, reductions, gathers, all_to_all: what each rank commits
* ``ring_reductions``: large sums, averages and products over a ring of point-to-point sends
* ``op_failures``: which failures mean the process group is broken, and their wording
"""
