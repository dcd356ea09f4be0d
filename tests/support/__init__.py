"""Test and benchmark support: not part of the product, not in the wheel."""
