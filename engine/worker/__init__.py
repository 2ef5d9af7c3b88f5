"""The worker process shell: HTTP app, engine thread, registration, metrics, internal wire.

Role-agnostic: ``tandem.prefill`` and ``tandem.decode`` (and the colocated role here) bring their
``WorkerRole``, which builds the role's hooks and KV connector (docs/architecture.md).
"""
