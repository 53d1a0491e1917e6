"""Where tensors live and how their bytes arrive: the lowest layer of a worker.

Modules:

* ``buffers``: how result buffers are allocated, when one may be reused, a copy without spinning
  threads
* ``store``: the named tensor store (quota, fences, uploads)
* ``replaced_memory``: memory of replaced values, kept for the next value of that size
* ``memory_release``: giving freed memory back to the system at once
* ``limits``: the data plane's limits as plain values
* ``shm_adopt``: client segments a worker keeps stored tensors in
* ``shm_segments``: the /dev/shm segments a worker creates for clients' gets
"""
