"""``Cluster``'s calls on named tensors: each part takes the session and is one concept.

===================  ===============================================================
module               what it holds
===================  ===============================================================
:mod:`.data_plane`   ``put``, ``get``, ``delete``, ``scatter``
:mod:`.collectives`  ``broadcast`` ... ``barrier``, ``new_group``; the coalesced forms
:mod:`.p2p`          ``send``, ``exchange``, ``destroy_group``
:mod:`.replicate`    ``put`` on every rank with each byte sent once
===================  ===============================================================
"""
