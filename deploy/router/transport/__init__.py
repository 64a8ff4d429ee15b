"""The router's HTTP client to its workers: the WorkerClient interface and the small HTTP/1.1 client under it."""
