"""The workers: the registry, health probes, circuit breakers, Kubernetes discovery, capacity and pair selection."""
