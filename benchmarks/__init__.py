"""Benchmarks: funcshard side by side with FSDP2, DDP and plain PyTorch. See README.md here."""
