"""The ``collectives`` command: a look at a running cluster from the client side.

==============  ===================================================================
module          what it holds
==============  ===================================================================
:mod:`.main`    the entry point: ``status``, ``top``, ``trace``, ``diagnose``, ``drain``,
                ``rollout``
:mod:`.flight`  ``collectives trace`` and ``collectives diagnose``
:mod:`.drains`  ``collectives drain`` and ``collectives rollout``
==============  ===================================================================
"""
