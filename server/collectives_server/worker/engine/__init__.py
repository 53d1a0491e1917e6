"""One generation's op pipeline (above ``models``).

Modules:

* ``handlers/``: one handler per op kind
* ``generation``: one generation's loop on one worker: sequence, announce, dispatch
* ``sequencer``: the leader's op queue: admission, order, ticks (pure)
* ``run_schedule``: the leader's runs: which ops run together, on which thread, when answered
* ``fusion``: which queued ops run together (pure)
* ``descriptor``: op announcements through the control rounds
* ``control_channel``: the control collectives over plain TCP
* ``control_rounds``: what announcements and agreements need from a group
* ``agreement``: exchanges and outcome agreements that keep every rank's view identical
* ``flight_recorder``: the bounded ring of every op this worker ran, with its phase times
* ``op_context``: what a handler sees of its rank and generation, and returns
* ``validation``: cross-rank operand validation (pure)
* ``uneven_validation``: the verdict of an uneven all_to_all (pure)
* ``process_groups``: building a generation's process groups, and the bound on its sub-groups
* ``groups_ahead``: a drain's next groups, formed while the current generation still serves
* ``device_completion``: an accelerator data group whose wait means completion on the device
* ``model_sync``: a generation's first step: every rank serves the newest model versions
* ``carried_groups``: a generation a drain carried over rebuilds the groups of the one before
"""
