"""gRPC for every daemon: servers, the error boundary, call limits, health.

Modules:

* ``server``: gRPC server construction shared by the coordinator and the workers
* ``call_context``: what a handler may use of its call's context, on gRPC and on a call lane
* ``errors``: the error boundary every servicer sits behind
* ``limits``: bounds on what one call may hold: a slot, a thread, time
* ``health``: grpc.health.v1 without the library servicer's shutdown deadlock
"""
