"""Kernel sources (package data); see the backend of the same vendor."""
