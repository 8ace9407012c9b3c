"""GPU data path of the daemon: CUDA IPC regions, a pinned Cache arena, device copies (optional, cupy)."""
