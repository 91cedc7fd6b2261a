"""Simulated replicas: the real engine (scheduler, block pool, prefix cache, preemption,
KV events, metrics, HTTP server) over a cost model instead of a model.

`pagefleet serve --simulate PROFILE` runs one; `pagefleet sim-fleet` hosts many on one
machine. Each step sleeps for what its profile says the step would take on the hardware it
models (profiles.py, cost_model.py), stretched by `--time-scale`, and emits tokens the
tokenizer decodes (runner.py). Routers then see what a real fleet of that size would show
them, so routing can be measured on fleets larger than this machine can run
(docs/routing.md).
"""
