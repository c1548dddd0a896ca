"""Schedulers decide which sequences are decoded together."""
