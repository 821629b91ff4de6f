"""Parallelism: the process group and device, FSDP1 and FSDP2 sharding, precision modes, sequence parallelism, tiled
MLP."""
