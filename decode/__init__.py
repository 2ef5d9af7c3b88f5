"""The decode worker: continuous batching over KV pulled from prefill workers.

``hooks.DecodeHooks`` is the policy the engine runs (the path of a remote-KV request, step by
step, is in its docstring); ``intake`` validates ``kv_transfer_params``; ``role.DecodeRole``
wires the hooks and the KV connector into the worker shell; ``cli`` is ``tandem decode``.
"""
