"""Unit tests, in one folder per qlora_fsdp subpackage (packages, so that two folders may hold files of the same
name)."""
