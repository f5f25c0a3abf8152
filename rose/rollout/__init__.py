"""Agentic rollout: the reference policy, the engine interface, the Redis task queue,
elastic placement and the worker process that the executor starts inside a lease
(`launcher`: the worker's one `WorkerConfig`, handed over off the command line).

Torch is imported only by the modules that need it (policy_model, engine, weight_source, worker_process), so the
control plane can import tasks, placement and pause_flag without the rollout extra.
"""
