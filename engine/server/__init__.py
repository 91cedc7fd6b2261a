"""The engine replica's HTTP server: the OpenAI API around `AsyncEngine`, Prometheus
metrics, and the KV capacity it publishes to Redis (`pagefleet serve`)."""
