"""The prefill worker: chunked prefill, then the KV hand-off to a decode worker.

``hooks.PrefillHooks`` is the policy the engine runs (stop after the first token, pin, publish,
release); ``role.PrefillRole`` wires it and its KV connector into the worker shell; ``cli`` is
``tandem prefill``.
"""
