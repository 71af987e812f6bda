"""OS-level tools for a running server: `minivllm monitor` (psutil / procfs samples) and `minivllm profile`
(perf stat counters, py-spy flame graph)."""
