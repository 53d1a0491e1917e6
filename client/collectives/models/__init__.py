"""Models on the cluster: loading, serving, training, publishing.

========================  ===========================================================
module                    what it holds
========================  ===========================================================
:mod:`.part`              ``Models``: ``load_model`` ... ``state_dict``, ``step``, ``train_step``
:mod:`.publish`           ``publish``: a model's new weights, sent once
:mod:`.archive_staging`   an uploaded archive staged on every rank by a replicated put
:mod:`.programs`          exported programs: code shipped to the workers without pickle
:mod:`.placement`         where a small forward runs: workers chosen by load
========================  ===========================================================

``collectives.data_parallel`` (public) builds on ``Models``.
"""
