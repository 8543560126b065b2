"""Data shipped with OLED-MoE (benchmark workloads under workloads/)."""
