"""The /v1/cache/* routes and what watches the cache: sessions and clearing (`admin`),
requests, probe and warm (`inspect`), Prometheus /metrics, and the dashboard."""
