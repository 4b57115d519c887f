"""Reference llama-class models used by the examples, tests and benchmarks."""
