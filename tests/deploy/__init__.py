"""The deployment files checked offline: Dockerfile, Compose, Kubernetes, KServe, the Prometheus rules and Grafana."""
