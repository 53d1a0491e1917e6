"""Hosted models (above ``kernels``).

Modules:

* ``archive/``: the torch.export archives a worker accepts, and how they arrive
* ``registry``: the models a worker hosts: loading, retained graphs, optimizer state
* ``execution``: forward and backward on tensors in the store
* ``device_replicas``: one kept copy of a model per local GPU, for forwards that only read it
* ``inputs_expected``: what an exported model takes, beside what a call gave it
* ``model_lock``: exclusive for what changes a model, shared by the forwards that only read it
* ``batching``: concurrent no-grad forwards of one model merged into one forward
* ``modes``: train and eval mode, and an exported graph's other-mode graph
* ``versions``: which weights a forward runs, and how a publish commits
* ``optimizers``: which optimizer a model steps with
* ``built_ahead``: the modules a drain's spare builds before the seal
"""
