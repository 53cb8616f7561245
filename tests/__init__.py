"""Tests of savable_loader."""
