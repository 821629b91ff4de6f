"""Benchmark harness: `python benchmarks/run.py --suite cpu|gpu` measures qlora-fsdp against the HF + PEFT peer."""
