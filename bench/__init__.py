"""Benchmarks of savable_loader against plain ``torch.utils.data.DataLoader`` (see docs/performance.md)."""
