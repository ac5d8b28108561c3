"""The driver gateway: the only pynvml user, the snapshot model, the kernel log's XIDs."""
